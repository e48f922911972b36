package session

import (
	"strings"

	"github.com/pgfence/pgfence/fence"
)

// How PostgreSQL reads a startup packet's settings (PostgreSQL 15,
// postinit.c process_startup_options; tcop/postgres.c
// process_postgres_switches), which New follows exactly:
//
//  1. the "options" parameter first: split into words by pg_split_opts
//     (at unescaped whitespace, a backslash taking the next byte as it
//     is), then read by getopt(3) with the server's switches,
//     "B:bC:c:D:d:EeFf:h:ijk:lN:nOPp:r:S:sTt:v:W:-:": flags group
//     (-ec x=y is -e then -c x=y), an argument is the rest of its word or
//     the next word (-cx=y, -c x=y), --name=value is the flag '-' with the
//     argument name=value, a word "--" ends the switches;
//  2. then every other parameter of the packet, which therefore overrides
//     what options set.
//
// Anything the server would refuse (an unknown flag, a flag missing its
// argument, -c without '=', a word that is not a switch) ends the
// connection there (FATAL 42601), so New refuses it with the same
// SQLSTATE. What the proxy could read differently from the server is
// refused with 08P01: two packet parameters whose names differ only in
// case (the server applies them in packet order, which the proxy does
// not keep), and an unescaped byte 0x85 or 0xA0 in options (whitespace
// to isspace(3) in some server locales, not in others).

// serverSwitches is process_postgres_switches' getopt string: a flag
// followed by ':' takes an argument.
const serverSwitches = "B:bC:c:D:d:EeFf:h:ijk:lN:nOPp:r:S:sTt:v:W:-:"

// CodeSyntaxError is the SQLSTATE PostgreSQL ends a connection with for
// options it cannot read, and New refuses them with.
const CodeSyntaxError = "42601"

// CodeProtocolViolation is the SQLSTATE New refuses a startup packet
// with whose settings the proxy cannot be certain to read as the server
// does.
const CodeProtocolViolation = "08P01"

func badSwitch(format string, args ...any) *fence.Error {
	e := invalid(format, args...)
	e.Code = CodeSyntaxError
	e.Hint = `The startup "options" are read as PostgreSQL reads them: -c name=value, -cname=value or --name=value, with "\ " for a space in a value.`
	return e
}

// splitOptions is pg_split_opts.
func splitOptions(options string) ([]string, error) {
	var args []string
	var b strings.Builder
	in, esc := false, false
	for i := 0; i < len(options); i++ {
		c := options[i]
		if !esc && (c == 0x85 || c == 0xa0) {
			e := invalid("pgfence: startup options contain an unescaped byte 0x%02x, which PostgreSQL may or may not read as a space depending on the server's locale", c)
			e.Code = CodeProtocolViolation
			e.Hint = `Escape it with a backslash.`
			return nil, e
		}
		if !esc && isSpace(c) {
			if in {
				args = append(args, b.String())
				b.Reset()
				in = false
			}
			continue
		}
		in = true
		if !esc && c == '\\' {
			esc = true
			continue
		}
		esc = false
		b.WriteByte(c)
	}
	if in {
		args = append(args, b.String())
	}
	return args, nil
}

// ParseOptions reads a startup "options" string as the server does (see
// above) and returns the (name, value) settings of its -c and --name=value
// switches in order, names lowercased with '-' turned into '_' (as
// ParseLongOption does; setting names are case-insensitive). The server's
// other switches set settings the proxy does not track (datestyle,
// work_mem, ...) and are skipped with their arguments. What the server
// would refuse is refused (42601).
func ParseOptions(options string) ([][2]string, error) {
	args, err := splitOptions(options)
	if err != nil {
		return nil, err
	}
	var out [][2]string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			if i+1 < len(args) {
				return nil, badSwitch("invalid command-line argument for server process: %s", args[i+1])
			}
			break
		}
		if len(a) < 2 || a[0] != '-' {
			return nil, badSwitch("invalid command-line argument for server process: %s", a)
		}
		// One word: flags, the last of them possibly taking the rest of
		// the word or the next word as its argument.
		for j := 1; j < len(a); j++ {
			flag := a[j]
			k := strings.IndexByte(serverSwitches, flag)
			if k < 0 || flag == ':' {
				return nil, badSwitch("invalid command-line argument for server process: %s", a)
			}
			if k+1 >= len(serverSwitches) || serverSwitches[k+1] != ':' {
				continue // a flag without an argument
			}
			var arg string
			if j+1 < len(a) {
				arg = a[j+1:]
			} else if i+1 < len(args) {
				i++
				arg = args[i]
			} else {
				return nil, badSwitch("option requires an argument -- '%c'", flag)
			}
			if flag == 'c' || flag == '-' {
				name, val, ok := strings.Cut(arg, "=")
				if !ok {
					if flag == '-' {
						return nil, badSwitch("--%s requires a value", arg)
					}
					return nil, badSwitch("-c %s requires a value", arg)
				}
				name = strings.ToLower(strings.ReplaceAll(name, "-", "_"))
				out = append(out, [2]string{name, val})
			}
			break
		}
	}
	return out, nil
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}
