package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
)

// version and commit are set at build time by the Makefile:
// -ldflags "-X main.version=$(git describe) -X main.commit=$(git rev-parse HEAD)",
// the commit with a "-dirty" suffix when the checkout has uncommitted changes.
// Without them, the build information the Go toolchain embeds is used: the
// module version for go install module@version, the VCS revision for a
// build from a checkout.
var (
	version = ""
	commit  = ""
)

// buildVersion is what pgfence version prints.
type buildVersion struct {
	Version    string `json:"version"`
	Module     string `json:"module"`
	Commit     string `json:"commit,omitempty"`
	CommitTime string `json:"commit_time,omitempty"`
	Modified   bool   `json:"modified,omitempty"`
	Go         string `json:"go"`
	Platform   string `json:"platform"`
}

func readVersion() buildVersion {
	v := buildVersion{Version: version, Commit: commit, Module: "github.com/pgfence/pgfence",
		Go: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if bi.Main.Path != "" {
			v.Module = bi.Main.Path
		}
		if v.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			v.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				if v.Commit == "" {
					v.Commit = s.Value
				}
			case "vcs.time":
				v.CommitTime = s.Value
			case "vcs.modified":
				v.Modified = v.Modified || s.Value == "true"
			}
		}
	}
	if c, ok := strings.CutSuffix(v.Commit, "-dirty"); ok {
		v.Commit, v.Modified = c, true
	}
	if v.Version == "" {
		v.Version = "devel"
	}
	return v
}

// versionString is the one line of pgfence --version.
func versionString() string {
	v := readVersion()
	s := "pgfence " + v.Version
	if v.Commit != "" {
		c := v.Commit
		if len(c) > 12 {
			c = c[:12]
		}
		s += " (commit " + c
		if v.Modified {
			s += ", modified"
		}
		s += ")"
	}
	return s + " " + v.Go + " " + v.Platform
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the pgfence version, commit and Go version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			v := readVersion()
			return printResult(cmd, output{json: v, text: func(out io.Writer) error {
				fmt.Fprintln(out, versionString())
				fmt.Fprintf(out, "module   %s\n", v.Module)
				if v.Commit != "" {
					fmt.Fprintf(out, "commit   %s", v.Commit)
					if v.Modified {
						fmt.Fprint(out, " (with uncommitted changes)")
					}
					fmt.Fprintln(out)
				}
				if v.CommitTime != "" {
					fmt.Fprintf(out, "date     %s\n", v.CommitTime)
				}
				return nil
			}})
		},
	}
}
