package pgtest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

var errNoReplica = errors.New("pgtest: cluster has no replica (Options.Replica)")

// CurrentLSN returns the primary's current WAL insert position.
func (c *Cluster) CurrentLSN(ctx context.Context) (string, error) {
	conn, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	var lsn string
	err = conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn)
	return lsn, err
}

// onReplica runs f on a connection to the replica's postgres database.
func (c *Cluster) onReplica(ctx context.Context, f func(conn *pgx.Conn) error) error {
	if c.Replica == nil {
		return errNoReplica
	}
	conn, err := c.Replica.Connect(ctx, "postgres")
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return f(conn)
}

// PauseReplay pauses WAL replay on the replica and returns once replay is
// actually paused (pg_get_wal_replay_pause_state() = 'paused'). WAL keeps
// streaming; it is only not applied.
func (c *Cluster) PauseReplay(ctx context.Context) error {
	return c.onReplica(ctx, func(conn *pgx.Conn) error {
		if _, err := conn.Exec(ctx, "SELECT pg_wal_replay_pause()"); err != nil {
			return fmt.Errorf("pause replay: %w", err)
		}
		return poll(ctx, func() (bool, error) {
			var state string
			err := conn.QueryRow(ctx, "SELECT pg_get_wal_replay_pause_state()").Scan(&state)
			return state == "paused", err
		})
	})
}

// ResumeReplay resumes WAL replay on the replica.
func (c *Cluster) ResumeReplay(ctx context.Context) error {
	return c.onReplica(ctx, func(conn *pgx.Conn) error {
		if _, err := conn.Exec(ctx, "SELECT pg_wal_replay_resume()"); err != nil {
			return fmt.Errorf("resume replay: %w", err)
		}
		return nil
	})
}

// ReplayLSN returns the replica's last replayed position.
func (c *Cluster) ReplayLSN(ctx context.Context) (lsn string, err error) {
	err = c.onReplica(ctx, func(conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text").Scan(&lsn)
	})
	return lsn, err
}

// WaitReplayed waits until the replica has replayed WAL up to lsn.
func (c *Cluster) WaitReplayed(ctx context.Context, lsn string) error {
	return c.onReplica(ctx, func(conn *pgx.Conn) error {
		return poll(ctx, func() (bool, error) {
			var ok bool
			err := conn.QueryRow(ctx, "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", lsn).Scan(&ok)
			return ok, err
		})
	})
}

// WaitReplicaCaughtUp waits until the replica has replayed everything the
// primary had written when it was called.
func (c *Cluster) WaitReplicaCaughtUp(ctx context.Context) error {
	lsn, err := c.CurrentLSN(ctx)
	if err != nil {
		return err
	}
	return c.WaitReplayed(ctx, lsn)
}

// poll calls cond every few milliseconds until it returns true, an error,
// or ctx ends (bounded to one minute).
func poll(ctx context.Context, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return PollEvery(ctx, 5*time.Millisecond, cond)
}

// PollEvery calls cond every interval until it returns true, an error, or
// ctx ends. It observes state; it is not a substitute for synchronisation.
func PollEvery(ctx context.Context, interval time.Duration, cond func() (bool, error)) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pgtest: condition not reached: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// Poll is poll for callers: wait until cond holds, observing state.
func Poll(ctx context.Context, cond func() (bool, error)) error { return poll(ctx, cond) }
