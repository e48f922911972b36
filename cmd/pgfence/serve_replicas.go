package main

import (
	"fmt"
	"os"
	"strconv"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/pgfence/pgfence/proxy"
)

// Read routing settings of `pgfence serve` (docs/reads.md).

func addReplicaFlags(f *pflag.FlagSet) {
	f.Bool("read-replicas", true, "route replica-eligible reads to the --replica servers (PGFENCE_READ_REPLICAS; default true when replicas are configured)")
	f.String("replica-poll", "", "how often replicas' replay positions are polled (PGFENCE_REPLICA_POLL; default 50ms)")
	f.String("replica-max-lag", "", "a replica whose replay lags more than this is out of rotation (PGFENCE_REPLICA_MAX_LAG; default 10s)")
}

// loadReplicaConfig merges the environment and flags into cfg.
func loadReplicaConfig(cmd *cobra.Command, cfg *serveConfig) error {
	if v, ok := os.LookupEnv("PGFENCE_READ_REPLICAS"); ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return fmt.Errorf("PGFENCE_READ_REPLICAS: %w", err)
		}
		cfg.ReadReplicas = &b
		cfg.from("read_replicas", "env")
	}
	if cmd.Flags().Changed("read-replicas") {
		b, _ := cmd.Flags().GetBool("read-replicas")
		cfg.ReadReplicas = &b
		cfg.from("read_replicas", "flag")
	}
	for _, k := range []struct {
		key string
		dst *string
	}{{"replica-poll", &cfg.ReplicaPoll}, {"replica-max-lag", &cfg.ReplicaMaxLag}} {
		if v, ok := os.LookupEnv("PGFENCE_" + envName(k.key)); ok {
			*k.dst = v
			cfg.from(k.key, "env")
		}
		if cmd.Flags().Changed(k.key) {
			*k.dst, _ = cmd.Flags().GetString(k.key)
			cfg.from(k.key, "flag")
		}
	}
	return nil
}

func envName(key string) string {
	b := []byte(key)
	for i, c := range b {
		switch {
		case c == '-':
			b[i] = '_'
		case c >= 'a' && c <= 'z':
			b[i] = c - 'a' + 'A'
		}
	}
	return string(b)
}

// applyReplicaConfig sets the read-routing fields of pc.
func (c serveConfig) applyReplicaConfig(pc *proxy.Config) error {
	pc.NoReplicaReads = c.ReadReplicas != nil && !*c.ReadReplicas
	if c.ReplicaPoll != "" {
		d, err := parseDuration(c.ReplicaPoll)
		if err != nil || d <= 0 {
			return fmt.Errorf("replica poll %q: want a positive duration such as 50ms", c.ReplicaPoll)
		}
		pc.ReplicaPoll = d
	}
	if c.ReplicaMaxLag != "" {
		d, err := parseDuration(c.ReplicaMaxLag)
		if err != nil || d <= 0 {
			return fmt.Errorf("replica max lag %q: want a positive duration such as 10s", c.ReplicaMaxLag)
		}
		pc.ReplicaMaxLag = d
	}
	return nil
}
