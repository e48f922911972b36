package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newLeaseCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "lease",
		Short: "(not implemented yet)",
		RunE: func(cmd *cobra.Command, args []string) error {
			return errors.New("lease: not implemented yet")
		},
	}
}
