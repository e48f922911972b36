package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/migrations"
)

func newMigrateCmd() *cobra.Command {
	var db database
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Install or upgrade the fence schema in a database (a DBA, once)",
		Long: `Install or upgrade pgfence's schema "fence" (sequences, fences, leases,
receipts, the protocol functions and the backstop trigger) and the roles
pgfence_worker, pgfence_bypass and pgfence_control. Safe to run repeatedly and
concurrently; the applied version is kept in public.pgfence_schema_version.

Run it as a superuser. It refuses a database where a schema "fence" or the
version table exists and is not a superuser's. Then grant pgfence_worker to
each application role that takes leases or writes protected tables, and
pgfence_control to the login role of the proxy's primary DSN:

    GRANT pgfence_worker TO app;
    GRANT pgfence_control TO pgfence;

It says how leases are taken there. Job authorization is off unless a DBA
turned it on: any worker may acquire any job key. Consumer authorization
likewise: the first role whose event is accepted under a new consumer name
keeps it. Leases of roles that are
not administrators last at most max_lease_ttl (1 day unless a DBA moved it
with fence.set_max_lease_ttl).`,
		Args: cobra.NoArgs,
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) {
			before, err := migrations.Current(ctx, conn)
			if err != nil {
				return output{}, err
			}
			if err := migrations.Apply(ctx, conn); err != nil {
				return output{}, err
			}
			after, err := migrations.Current(ctx, conn)
			if err != nil {
				return output{}, err
			}
			line := fmt.Sprintf("fence schema migrated from version %d to %d", before, after)
			if before == after {
				line = fmt.Sprintf("fence schema is up to date (version %d)", after)
			}
			auth, consumers, ttl, err := leaseDefaults(ctx, conn)
			if err != nil {
				return output{}, err
			}
			lines := []string{line}
			if !auth {
				lines = append(lines, "job authorization is off: any role in pgfence_worker may acquire any job key, a key another role will need included (docs/security.md);",
					"  to allow each role only its own keys: SELECT fence.set_job_authorization(true); SELECT fence.grant_job('<role>', '<pattern>');")
			}
			if !consumers {
				lines = append(lines, "consumer authorization is off: the first role whose event is accepted under a new consumer name keeps it (docs/security.md);",
					"  to allow each role only its own names: SELECT fence.set_consumer_authorization(true); SELECT fence.grant_consumer('<role>', '<pattern>');")
			}
			if ttl == nil {
				lines = append(lines, "leases have no time limit: a worker may hold one as long as it asks; SELECT fence.set_max_lease_ttl('1 day'); sets one")
			} else {
				lines = append(lines, fmt.Sprintf("leases of non-administrators are limited to %s (fence.set_max_lease_ttl moves the limit)", *ttl))
			}
			catalogValues, err := catalogValueTables(ctx, conn)
			if err != nil {
				return output{}, err
			}
			for _, c := range catalogValues {
				lines = append(lines, fmt.Sprintf("protected table %s has a %s whose values read the current names of catalog objects, not the row's own: have an administrator turn it into text (ALTER TABLE … ALTER COLUMN … TYPE text keeps the names the rows read now) or oid (docs/security.md, Known limits)", c.Table, c.Column))
			}
			return output{json: map[string]any{"from_version": before, "version": after, "migrated": before != after,
				"job_authorization": auth, "consumer_authorization": consumers, "max_lease_ttl": ttl,
				"catalog_value_columns": catalogValues},
				text: textf("%s", strings.Join(lines, "\n"))}, nil
		}),
	}
	db.addFlag(cmd.Flags())
	return cmd
}

// leaseDefaults reads whether job and consumer authorization are on and
// the lease TTL limit (nil: none) of a migrated database.
func leaseDefaults(ctx context.Context, conn *pgx.Conn) (auth, consumers bool, ttl *string, err error) {
	err = conn.QueryRow(ctx, `select coalesce((select s.value = 'on' from fence.settings s where s.name = 'job_authorization'), false),
		coalesce((select s.value = 'on' from fence.settings s where s.name = 'consumer_authorization'), false),
		(select s.value from fence.settings s where s.name = 'max_lease_ttl')`).Scan(&auth, &consumers, &ttl)
	if err != nil {
		return false, false, nil, fmt.Errorf("read the lease settings: %w", err)
	}
	return auth, consumers, ttl, nil
}

// catalogValue is a protected table with a column whose values read
// through the catalog (a regclass, regproc, … or aclitem), which the
// table had before pgfence refused such columns (migration
// oid_alias_columns).
type catalogValue struct {
	Table  string `json:"table"`
	Column string `json:"column"`
}

// catalogValueTables reads fence.catalog_value_tables.
func catalogValueTables(ctx context.Context, conn *pgx.Conn) ([]catalogValue, error) {
	rows, err := conn.Query(ctx, "select relid::pg_catalog.text, what from fence.catalog_value_tables()")
	if err != nil {
		return nil, fmt.Errorf("read fence.catalog_value_tables: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (catalogValue, error) {
		var c catalogValue
		err := r.Scan(&c.Table, &c.Column)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("read fence.catalog_value_tables: %w", err)
	}
	return out, nil
}
