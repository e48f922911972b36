//go:build !pgfence_chaos_broken

package chaos

import "context"

// brokenBuild is false in every real build: see broken.go.
const brokenBuild = false

func (w *worker) attemptBroken(context.Context, string, string, string) (string, string, string) {
	panic("chaos: attemptBroken in a correct build")
}
