package fence_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
)

// TestSyncPromotionLosslessWhateverSession (attack round 14, Z-M1): the
// era of a synchronous standby's promotion is lossless whichever session
// settles it. A worker whose session had standard_conforming_strings off
// called fence.current_era() first on the promoted server; PL/pgSQL read
// the '\s' of the timeline history's pattern as 's', the history's line
// was "not a timeline switch", and the era was lossy: every generation
// of every role void (FN015).
func TestSyncPromotionLosslessWhateverSession(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, map[string]string{"synchronous_standby_names": "'*'"})
	ctx := ctxT(t)
	if _, err := e.connect("", nil).Exec(ctx, "select fence.set_failover_mode('sync')"); err != nil {
		t.Fatal(err)
	}
	b := e.acquire("wb", "j") // its commit waits for the standby
	if err := e.c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	// The new primary has no standby: as Patroni does, it stops waiting
	// for one (else the era's row would wait for ever).
	admin := e.connect("", nil)
	for _, sql := range []string{"alter system set synchronous_standby_names = ''", "select pg_reload_conf()"} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := pgx.ParseConfig(e.c.Primary.DSN(e.db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.User = "wa"
	cfg.RuntimeParams["options"] = "-c standard_conforming_strings=off"
	wa, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer wa.Close(context.Background())
	var lossless bool
	var reason string
	if err := wa.QueryRow(ctx, "select lossless, reason from fence.current_era()").Scan(&lossless, &reason); err != nil {
		t.Fatal(err)
	}
	if !lossless {
		t.Fatalf("the era a worker with standard_conforming_strings off settled after a synchronous standby's promotion is lossy: %s", reason)
	}
	if err := e.write("wb", b, "b"); err != nil {
		t.Fatalf("B, the live holder, writes after the failover: %v (%s)", err, fence.Code(err))
	}
}
