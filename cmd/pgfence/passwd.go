package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newPasswdCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "passwd",
		Short: "(not implemented yet)",
		RunE: func(cmd *cobra.Command, args []string) error {
			return errors.New("passwd: not implemented yet")
		},
	}
}
