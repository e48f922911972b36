package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/pgfence/pgfence/proxy"
)

func newPasswdCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "passwd USER",
		Short: "Print a users-file line with a SCRAM-SHA-256 verifier for USER",
		Long: `Read a password (prompted without echo on a terminal, else the first line
of stdin) and print a line for the --auth-file of pgfence serve:

  "USER" "SCRAM-SHA-256$4096:<salt>$<StoredKey>:<ServerKey>"

The file never holds the password itself, only the verifier. In a script:

  pgfence passwd app <<<"$APP_PASSWORD" >>users.txt`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			pw, err := readPassword(cmd.InOrStdin(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			v, err := proxy.MakeVerifier(args[0], pw)
			if err != nil {
				return err
			}
			line := proxy.QuoteUserLine(args[0], v)
			return printResult(cmd, output{json: map[string]string{"user": args[0], "verifier": v, "line": line}, text: textf("%s", line)})
		},
	}
}

// readPassword prompts with echo off when in is a terminal.
func readPassword(in io.Reader, prompt io.Writer) (string, error) {
	if f, ok := in.(*os.File); ok {
		if old, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS); err == nil {
			noEcho := *old
			noEcho.Lflag &^= unix.ECHO
			fmt.Fprint(prompt, "Password: ")
			if err := unix.IoctlSetTermios(int(f.Fd()), unix.TCSETS, &noEcho); err == nil {
				defer func() {
					unix.IoctlSetTermios(int(f.Fd()), unix.TCSETS, old)
					fmt.Fprintln(prompt)
				}()
			}
		}
	}
	line, err := bufio.NewReader(in).ReadString('\n')
	if err != nil && !(errors.Is(err, io.EOF) && line != "") {
		return "", fmt.Errorf("read password: %w", err)
	}
	pw := strings.TrimRight(line, "\r\n")
	if pw == "" {
		return "", errors.New("empty password")
	}
	return pw, nil
}
