package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// DetachReplica stops the replica's WAL receiver and returns once it has
// stopped (pg_stat_wal_receiver is empty): what the primary commits from
// now on does not reach the replica, as in the window of an asynchronous
// failover that loses the primary's last transactions. The replica keeps
// serving reads of what it has.
func (c *Cluster) DetachReplica(ctx context.Context) error {
	if c.Replica == nil {
		return errNoReplica
	}
	return c.DetachNode(ctx, c.Replica)
}

// DetachNode is DetachReplica for any standby of the cluster (one
// AddStandby made).
func (c *Cluster) DetachNode(ctx context.Context, n *Node) error {
	conn, err := n.Connect(ctx, "postgres")
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "ALTER SYSTEM SET primary_conninfo = ''"); err != nil {
		return fmt.Errorf("detach replica: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("detach replica: %w", err)
	}
	return poll(ctx, func() (bool, error) {
		var n int
		err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_wal_receiver").Scan(&n)
		return n == 0, err
	})
}

// Failover kills the primary (SIGKILL, as a crash), promotes the replica
// (pg_promote, which waits until it accepts writes) and makes it the
// cluster's Primary; the cluster has no replica after it. What the replica
// had received is replayed before it is promoted; what it had not (after
// DetachReplica) is lost.
func (c *Cluster) Failover(ctx context.Context) error {
	if c.Replica == nil {
		return errNoReplica
	}
	if err := c.Primary.Kill(); err != nil {
		return fmt.Errorf("kill primary: %w", err)
	}
	err := c.onReplica(ctx, func(conn *pgx.Conn) error {
		var ok bool
		if err := conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&ok); err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("pg_promote: not promoted within 60 s")
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("promote replica: %w", err)
	}
	c.mu.Lock()
	c.Primary, c.Replica = c.Replica, nil
	c.mu.Unlock()
	return nil
}

// AddReplica makes a new streaming replica of the current primary
// (pg_basebackup -R, as Start does) and starts it: after a Failover, which
// leaves the cluster without one, a test can fail over again. opts gives
// the new node's settings, as Start's did.
func (c *Cluster) AddReplica(ctx context.Context, opts Options) error {
	c.mu.Lock()
	if c.Replica != nil {
		c.mu.Unlock()
		return fmt.Errorf("pgtest: the cluster already has a replica")
	}
	c.replicas++
	name := fmt.Sprintf("replica%d", c.replicas+1)
	p := c.Primary
	c.mu.Unlock()
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 60 * time.Second
	}
	r, err := c.newNode(ctx, name, opts, "pg_basebackup", "-h", p.Host, "-p", strconv.Itoa(p.Port),
		"-U", "postgres", "-R", "-X", "stream", "-c", "fast", "--no-sync")
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	c.mu.Lock()
	c.Replica = r
	c.mu.Unlock()
	return nil
}

// AddStandby makes another streaming replica, of from (the primary or a
// standby: a cascading one), and starts it. It is not the cluster's
// Replica (Failover does not promote it); Close stops it. opts gives its
// settings, as Start's did, and may give its port.
func (c *Cluster) AddStandby(ctx context.Context, from *Node, opts Options) (*Node, error) {
	c.mu.Lock()
	c.replicas++
	name := fmt.Sprintf("standby%d", c.replicas+1)
	c.mu.Unlock()
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 60 * time.Second
	}
	n, err := c.newNode(ctx, name, opts, "pg_basebackup", "-h", from.Host, "-p", strconv.Itoa(from.Port),
		"-U", "postgres", "-R", "-X", "stream", "-c", "fast", "--no-sync")
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.extra = append(c.extra, n)
	c.mu.Unlock()
	if err := n.Start(ctx); err != nil {
		return nil, err
	}
	return n, nil
}

// ReplayedOn waits until standby n has replayed WAL up to lsn.
func (c *Cluster) ReplayedOn(ctx context.Context, n *Node, lsn string) error {
	conn, err := n.Connect(ctx, "postgres")
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return poll(ctx, func() (bool, error) {
		var ok bool
		err := conn.QueryRow(ctx, "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", lsn).Scan(&ok)
		return ok, err
	})
}

// AddNode makes node name from a base backup of the current primary and
// starts it: with standby, a streaming standby (pg_basebackup -R) that the
// cluster does not use as its Replica (a second standby of one primary);
// without, a copy that starts as a primary of its own by crash recovery
// from the backup (a physical backup restored without recovery.signal:
// the same system identifier and timeline). start false leaves it
// stopped (Start it later, as a backup restored after a loss). Close
// stops it.
func (c *Cluster) AddNode(ctx context.Context, name string, opts Options, standby, start bool) (*Node, error) {
	c.mu.Lock()
	p := c.Primary
	c.mu.Unlock()
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 60 * time.Second
	}
	args := []string{"-h", p.Host, "-p", strconv.Itoa(p.Port), "-U", "postgres", "-X", "stream", "-c", "fast", "--no-sync"}
	if standby {
		args = append(args, "-R")
	}
	n, err := c.newNode(ctx, name, opts, "pg_basebackup", args...)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.extra = append(c.extra, n)
	c.mu.Unlock()
	if start {
		if err := n.Start(ctx); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// FailoverTo kills the current primary (SIGKILL, as a crash) and promotes
// standby n (pg_promote, which waits until it accepts writes), which
// becomes the cluster's Primary. What n had not received is lost.
func (c *Cluster) FailoverTo(ctx context.Context, n *Node) error {
	if err := c.Primary.Kill(); err != nil {
		return fmt.Errorf("kill primary: %w", err)
	}
	conn, err := n.Connect(ctx, "postgres")
	if err != nil {
		return fmt.Errorf("promote %s: %w", n.Name, err)
	}
	defer conn.Close(ctx)
	var ok bool
	if err := conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&ok); err != nil {
		return fmt.Errorf("promote %s: %w", n.Name, err)
	}
	if !ok {
		return fmt.Errorf("promote %s: not promoted within 60 s", n.Name)
	}
	c.mu.Lock()
	if c.Replica == n {
		c.Replica = nil
	}
	c.Primary = n
	c.mu.Unlock()
	return nil
}

// UsePrimary makes n, a running node that accepts writes (a restored
// copy), the cluster's Primary.
func (c *Cluster) UsePrimary(n *Node) {
	c.mu.Lock()
	c.Primary = n
	c.mu.Unlock()
}

// SetConf appends settings to node n's postgresql.conf, read at its next
// start (or reload): the recovery settings of a restored copy, say.
func (n *Node) SetConf(settings map[string]string) error {
	return appendConf(n.DataDir, settings)
}

// WriteFile writes name, a path in n's data directory, owned by the
// server's user (a signal file such as recovery.signal).
func (n *Node) WriteFile(name string, data []byte) error {
	p := filepath.Join(n.DataDir, name)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		return err
	}
	return n.c.chown(p)
}

// RemoveFile removes name, a path in n's data directory, if it exists.
func (n *Node) RemoveFile(name string) error {
	err := os.Remove(filepath.Join(n.DataDir, name))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}
