package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newProtectCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "protect",
		Short: "(not implemented yet)",
		RunE: func(cmd *cobra.Command, args []string) error {
			return errors.New("protect: not implemented yet")
		},
	}
}
