package runner

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
)

// lossReport says why the lease is no longer ours. confirmed means the
// database said so (FN001, FN004, FN005, FN015); otherwise renewals failed
// until the lease would have expired, and we fail closed. void means the
// database said the generation is void after a failover (FN015): the job
// is free, and the run may acquire it again (Config.FailoverRestarts).
type lossReport struct {
	err       error
	confirmed bool
	void      bool
}

// renewer renews one lease every cfg.RenewEvery until its context ends or
// the lease is lost.
type renewer struct {
	store    *leases
	cfg      *Config
	log      *zap.Logger
	lease    held
	deadline time.Time // the lease expires no later than this, by our clock
}

// retryEvery is the pause after a failed renewal.
func (rn *renewer) retryEvery() time.Duration {
	return min(rn.cfg.RenewEvery, time.Second)
}

// run reports a loss on lost (capacity 1) at most once, then returns.
func (rn *renewer) run(ctx context.Context, lost chan<- lossReport) {
	next := rn.cfg.RenewEvery
	failures := 0
	for {
		t := time.NewTimer(next)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		sent := time.Now()
		// Give the attempt until the lease would expire; when it already
		// has by our clock (we were paused), still ask once: if nobody took
		// over, the token is current and renewing it is safe.
		attemptDeadline := rn.deadline
		if !attemptDeadline.After(sent) {
			attemptDeadline = sent.Add(rn.cfg.RenewEvery)
		}
		actx, cancel := context.WithDeadline(ctx, attemptDeadline)
		exp, err := rn.store.renew(actx, rn.lease.JobKey, rn.lease.Token, rn.cfg.TTL)
		cancel()
		if ctx.Err() != nil {
			return
		}
		switch {
		case err == nil:
			rn.deadline = sent.Add(rn.cfg.TTL)
			if failures > 0 {
				rn.log.Info("lease renewed after failures", zap.Int("failures", failures), zap.Time("expires_at", exp))
			} else {
				rn.log.Debug("lease renewed", zap.Time("expires_at", exp))
			}
			failures = 0
			next = rn.cfg.RenewEvery
		case isGone(err):
			lost <- lossReport{err: fmt.Errorf("renew: %w", err), confirmed: true, void: fence.IsFailover(err)}
			return
		default:
			failures++
			left := time.Until(rn.deadline)
			if left <= 0 {
				lost <- lossReport{err: fmt.Errorf("renew: could not renew before the lease expired (%d failed attempts): %w", failures, err)}
				return
			}
			rn.log.Warn("lease renewal failed; retrying until it expires",
				zap.Int("failures", failures), zap.Int64("left_ms", left.Milliseconds()), zap.Error(err))
			next = min(rn.retryEvery(), left)
		}
	}
}
