package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newGCCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "gc",
		Short: "(not implemented yet)",
		RunE: func(cmd *cobra.Command, args []string) error {
			return errors.New("gc: not implemented yet")
		},
	}
}
