package fence

import (
	"context"
	"crypto/sha256"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// DBTX is what the fence functions run on: *pgx.Conn, pgx.Tx and
// *pgxpool.Pool all satisfy it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Generation names one commit scope: a job's epoch and token, and the step
// within the token ("" for one result commit per token).
type Generation struct {
	JobKey string
	Epoch  int64
	Token  int64
	Step   string
}

func (g Generation) String() string {
	s := g.JobKey + "@" + strconv.FormatInt(g.Epoch, 10) + "/" + strconv.FormatInt(g.Token, 10)
	if g.Step != "" {
		s += "/" + g.Step
	}
	return s
}

// Lease is a lease granted by Acquire.
type Lease struct {
	JobKey    string
	Epoch     int64
	Token     int64
	Holder    string
	ExpiresAt time.Time
}

// Generation returns the lease's generation with the given step.
func (l Lease) Generation(step string) Generation {
	return Generation{JobKey: l.JobKey, Epoch: l.Epoch, Token: l.Token, Step: step}
}

// GateResult is the outcome of Gate.
type GateResult int

const (
	// GateOK: the generation holds the fence; the transaction may write and
	// commit.
	GateOK GateResult = iota + 1
	// GateReplay: a receipt exists for the generation and step. The
	// transaction can never commit; Commit reports Replayed or a conflict.
	GateReplay
)

func (r GateResult) String() string {
	switch r {
	case GateOK:
		return "ok"
	case GateReplay:
		return "replay"
	}
	return "GateResult(" + strconv.Itoa(int(r)) + ")"
}

// CommitResult is the outcome of Commit and RunTx.
type CommitResult int

const (
	// Committed: the receipt was written; commit the transaction.
	Committed CommitResult = iota + 1
	// Replayed: the generation and step already committed with the same
	// payload. The first commit stands; this transaction is aborted and
	// must be rolled back.
	Replayed
	// NotWritten (CommitIfWritten only): the transaction changed no
	// protected table under the generation; no receipt was written.
	NotWritten
)

func (r CommitResult) String() string {
	switch r {
	case Committed:
		return "committed"
	case Replayed:
		return "replayed"
	case NotWritten:
		return "not written"
	}
	return "CommitResult(" + strconv.Itoa(int(r)) + ")"
}

func interval(d time.Duration) pgtype.Interval {
	return pgtype.Interval{Microseconds: d.Microseconds(), Valid: true}
}

// Acquire takes the lease on jobKey for holder, for ttl. It issues a new
// token (a new epoch too when the job is new or retired) and advances the
// fence in the same transaction, so every older token is fenced off from the
// moment it returns. A live lease of another holder gives CodeLeaseHeld; the
// same holder re-acquiring gets a new token.
func Acquire(ctx context.Context, db DBTX, jobKey, holder string, ttl time.Duration) (Lease, error) {
	l := Lease{JobKey: jobKey, Holder: holder}
	err := confirmed(ctx, db, func(db DBTX) error {
		return db.QueryRow(ctx, "select epoch, token, expires_at from fence.acquire($1::pg_catalog.text, $2::pg_catalog.text, $3::pg_catalog.interval)",
			jobKey, holder, interval(ttl)).Scan(&l.Epoch, &l.Token, &l.ExpiresAt)
	})
	if err != nil {
		return Lease{}, fmt.Errorf("acquire %q: %w", jobKey, FromPostgres(err))
	}
	return l, nil
}

// Renew extends the lease held with token by ttl from now and returns the
// new expiry.
func Renew(ctx context.Context, db DBTX, jobKey string, token int64, ttl time.Duration) (time.Time, error) {
	var exp time.Time
	err := confirmed(ctx, db, func(db DBTX) error {
		return db.QueryRow(ctx, "select fence.renew($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.interval)", jobKey, token, interval(ttl)).Scan(&exp)
	})
	if err != nil {
		return time.Time{}, fmt.Errorf("renew %q: %w", jobKey, FromPostgres(err))
	}
	return exp, nil
}

// Release ends the lease held with token now. The token stays the fence's
// current one until the next Acquire.
func Release(ctx context.Context, db DBTX, jobKey string, token int64) error {
	err := confirmed(ctx, db, func(db DBTX) error {
		_, err := db.Exec(ctx, "select fence.release($1::pg_catalog.text, $2::pg_catalog.int8)", jobKey, token)
		return err
	})
	if err != nil {
		return fmt.Errorf("release %q: %w", jobKey, FromPostgres(err))
	}
	return nil
}

// RetireOptions say whose retire it is.
type RetireOptions struct {
	// Token is the caller's current token: the holder ends its own job
	// (its own live lease ends with it). It must be the job's current
	// token (else CodeStale) and the caller the role that acquired it
	// (else CodeNotOwner), unless the caller is an administrator. Zero
	// retires without a token, which only an administrator may do
	// (pgfence_bypass or a superuser; else CodeNotOwner).
	Token int64
	// Force, without a token, also ends a live lease; without it, a live
	// lease gives CodeLeaseHeld.
	Force bool
}

// Retire closes the job's current epoch. Requests naming it get
// CodeRetired; the next Acquire opens a new epoch with a larger token.
// Retiring a retired job is a no-op.
func Retire(ctx context.Context, db DBTX, jobKey string, opts RetireOptions) error {
	var token *int64
	if opts.Token != 0 {
		token = &opts.Token
	}
	err := confirmed(ctx, db, func(db DBTX) error {
		_, err := db.Exec(ctx, "select fence.retire($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.bool)", jobKey, token, opts.Force)
		return err
	})
	if err != nil {
		return fmt.Errorf("retire %q: %w", jobKey, FromPostgres(err))
	}
	return nil
}

// Gate binds the transaction to g and checks the fence. It sets the
// transaction-local settings fence.job_key, fence.epoch, fence.token and
// fence.step (so the backstop triggers of protected tables let the
// transaction's writes through) and calls fence.gate, which locks the fence
// row until the transaction ends and writes the transaction's provisional
// receipt (it commits with the transaction even if Commit is never called,
// so a retry is a replay). tx must be a transaction.
func Gate(ctx context.Context, tx DBTX, g Generation) (GateResult, error) {
	var res string
	err := tx.QueryRow(ctx, `select fence.gate($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text),
		pg_catalog.set_config('fence.job_key', $1, true), pg_catalog.set_config('fence.epoch', $2::pg_catalog.int8::pg_catalog.text, true),
		pg_catalog.set_config('fence.token', $3::pg_catalog.int8::pg_catalog.text, true), pg_catalog.set_config('fence.step', $4, true)`,
		g.JobKey, g.Epoch, g.Token, g.Step).Scan(&res, nil, nil, nil, nil)
	if err != nil {
		return 0, fmt.Errorf("gate %s: %w", g, FromPostgres(err))
	}
	switch res {
	case "ok":
		return GateOK, nil
	case "replay":
		return GateReplay, nil
	}
	return 0, fmt.Errorf("gate %s: unexpected answer %q", g, res)
}

// Commit writes the receipt for g with the payload digest; call it as the
// last statement before COMMIT. Committed: commit the transaction. Replayed
// (nil error): the same payload already committed; the transaction is
// aborted, roll it back. A different payload gives CodeConflict; a fence
// that moved on gives CodeStale (or CodeRetired, CodeExpired).
func Commit(ctx context.Context, tx DBTX, g Generation, digest []byte, version string) (CommitResult, error) {
	res, err := receipt(ctx, tx, "fence.commit", g, digest, version)
	if res == NotWritten { // fence.commit never answers "none"
		return 0, fmt.Errorf(`commit %s: unexpected answer "none"`, g)
	}
	return res, err
}

// CommitIfWritten is Commit for a transaction whose writes the caller
// cannot see (a function, a DO block, a trigger): it writes the receipt
// for g, with Commit's checks and errors, only when the transaction
// changed a protected table under g (the backstop wrote its provisional
// receipt), and answers NotWritten otherwise. A transaction that entered
// replay mode for g gives Replayed or CodeConflict, as Commit does. Without
// either call, the provisional receipt commits as it is, with digest
// version BackstopDigestVersion.
func CommitIfWritten(ctx context.Context, tx DBTX, g Generation, digest []byte, version string) (CommitResult, error) {
	return receipt(ctx, tx, "fence.commit_if_written", g, digest, version)
}

// receipt calls the receipt function fn (fence.commit or
// fence.commit_if_written) for g: Committed, NotWritten ("none"), or
// Replayed when the server answers FN00R.
func receipt(ctx context.Context, tx DBTX, fn string, g Generation, digest []byte, version string) (CommitResult, error) {
	var res string
	err := tx.QueryRow(ctx, "select "+fn+"($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text, $5::pg_catalog.bytea, $6::pg_catalog.text)",
		g.JobKey, g.Epoch, g.Token, g.Step, digest, version).Scan(&res)
	if err != nil {
		err = FromPostgres(err)
		if Code(err) == CodeReplay {
			return Replayed, nil
		}
		return 0, fmt.Errorf("commit %s: %w", g, err)
	}
	switch res {
	case "committed":
		return Committed, nil
	case "none":
		return NotWritten, nil
	}
	return 0, fmt.Errorf("commit %s: unexpected answer %q", g, res)
}

// BackstopDigestVersion is the digest version of the provisional receipt
// the database writes at a transaction's first fenced write (fence.gate or
// the backstop), which Commit replaces: SHA-256 of the text of that
// statement. A receipt that commits with it was never given a digest by
// Commit or CommitIfWritten.
const BackstopDigestVersion = "backstop-v1"

// PayloadDigestVersion is the digest version RunTx stores: SHA-256 of the
// caller's payload bytes.
const PayloadDigestVersion = "payload-sha256"

// PayloadDigest is the digest RunTx stores for payload.
func PayloadDigest(payload []byte) []byte {
	s := sha256.Sum256(payload)
	return s[:]
}

// Beginner starts transactions: *pgx.Conn and *pgxpool.Pool satisfy it.
type Beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// TxFunc writes a transaction's results.
type TxFunc func(ctx context.Context, tx pgx.Tx) error

// RunTx runs fn as one gated, receipted transaction of generation g:
// begin → Gate → fn → Commit → COMMIT. payload is a canonical encoding of
// the result fn writes (same result, same bytes); its SHA-256 is the
// receipt's digest, so a retry after a lost commit response returns
// Replayed without running fn, and a different payload for the same
// generation and step returns CodeConflict.
//
// An error from fn rolls the transaction back and is returned as is.
func RunTx(ctx context.Context, db Beginner, g Generation, payload []byte, fn TxFunc) (CommitResult, error) {
	return RunTxOptions(ctx, db, pgx.TxOptions{}, g, payload, fn)
}

// RunTxOptions is RunTx with transaction options (isolation level).
func RunTxOptions(ctx context.Context, db Beginner, opts pgx.TxOptions, g Generation, payload []byte, fn TxFunc) (res CommitResult, err error) {
	tx, err := db.BeginTx(ctx, opts)
	if err != nil {
		return 0, fmt.Errorf("begin %s: %w", g, err)
	}
	defer func() {
		if res != Committed || err != nil {
			tx.Rollback(ctx)
		}
	}()
	gr, err := Gate(ctx, tx, g)
	if err != nil {
		return 0, err
	}
	if gr == GateOK {
		if err := fn(ctx, tx); err != nil {
			return 0, err
		}
	}
	res, err = Commit(ctx, tx, g, PayloadDigest(payload), PayloadDigestVersion)
	if err != nil {
		return 0, err
	}
	if res == Committed {
		if err := tx.Commit(ctx); err != nil {
			// The outcome is unknown (the response may be lost): a retry
			// with the same payload answers Replayed or stale.
			return 0, fmt.Errorf("commit %s: %w", g, FromPostgres(err))
		}
	}
	return res, nil
}

// GC deletes receipts of closed generations committed more than keep ago
// and returns how many it deleted. Retries of pruned generations get
// CodeExpired. Jobs whose fence row is locked are skipped this time.
func GC(ctx context.Context, db DBTX, keep time.Duration) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, "select fence.gc($1::pg_catalog.interval)", interval(keep)).Scan(&n); err != nil {
		return 0, fmt.Errorf("gc: %w", FromPostgres(err))
	}
	return n, nil
}

// AcceptEvent records, in the caller's transaction, that consumer processes
// the event of (jobKey, epoch, token), and reports whether it should: a
// newer epoch (not retired) or a token at least the stored one in the same
// epoch is accepted and persisted; older epochs, retired epochs and smaller
// tokens are rejected and change nothing.
func AcceptEvent(ctx context.Context, db DBTX, consumer, jobKey string, epoch, token int64) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, "select fence.accept_event($1::pg_catalog.text, $2::pg_catalog.text, $3::pg_catalog.int8, $4::pg_catalog.int8)", consumer, jobKey, epoch, token).Scan(&ok); err != nil {
		return false, fmt.Errorf("accept event %s@%d/%d for %q: %w", jobKey, epoch, token, consumer, FromPostgres(err))
	}
	return ok, nil
}

// Protect installs the backstop trigger on table (a name as in SQL,
// optionally schema-qualified and quoted) and on its whole tree: every
// partition and sub-partition, every inheritance child, now and later.
// A partition or child is not protected alone: its root is (the error
// names it). jobKeyColumn, when not empty, also scopes rows: a fenced
// session may only write rows whose column equals its fence.job_key.
// Protecting a protected table again with the same column is a no-op; with
// another column it is an error.
func Protect(ctx context.Context, db DBTX, table, jobKeyColumn string) error {
	var col *string
	if jobKeyColumn != "" {
		col = &jobKeyColumn
	}
	if _, err := db.Exec(ctx, "select fence.protect($1::pg_catalog.regclass, $2::pg_catalog.text)", table, col); err != nil {
		return fmt.Errorf("protect %s: %w", table, FromPostgres(err))
	}
	return nil
}

// Unprotect removes the backstop from table, a protected root, and its
// whole tree; a table that is not protected is left as it is. It needs an
// administrator (pgfence_bypass or a superuser): else CodeProtectionLocked.
func Unprotect(ctx context.Context, db DBTX, table string) error {
	if _, err := db.Exec(ctx, "select fence.unprotect($1::pg_catalog.regclass)", table); err != nil {
		return fmt.Errorf("unprotect %s: %w", table, FromPostgres(err))
	}
	return nil
}

// ProtectedTable is one member of a protected tree (fence.protected_tables).
type ProtectedTable struct {
	Schema       string
	Table        string
	Root         string // the protected table it is protected through, as SQL names it; Table's own name for a root
	JobKeyColumn string // "" when rows are not scoped
	ProtectedAt  time.Time
	Exists       bool // false if the table was dropped after protecting
}

// ProtectedTables lists the protected tables, every member of every
// protected tree, by schema and name. Names are the tables' current ones:
// protection follows the table, not its name.
func ProtectedTables(ctx context.Context, db DBTX) ([]ProtectedTable, error) {
	rows, err := db.Query(ctx, `select coalesce(n.nspname::pg_catalog.text, p.schema_name), coalesce(c.relname::pg_catalog.text, p.table_name),
		coalesce(p.root::pg_catalog.text, ''), coalesce(p.job_key_column, ''), p.protected_at, c.oid is not null
		from fence.protected_tables as p
		left join pg_catalog.pg_class as c on c.oid operator(pg_catalog.=) p.relid::pg_catalog.oid
		left join pg_catalog.pg_namespace as n on n.oid operator(pg_catalog.=) c.relnamespace
		order by 1, 2`)
	if err != nil {
		return nil, fmt.Errorf("list protected tables: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ProtectedTable, error) {
		var t ProtectedTable
		err := r.Scan(&t.Schema, &t.Table, &t.Root, &t.JobKeyColumn, &t.ProtectedAt, &t.Exists)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("list protected tables: %w", err)
	}
	return out, nil
}

// Era is the era a server is in (fence.current_era()): docs/failover.md.
type Era struct {
	Era      int       `json:"era"`
	Timeline int       `json:"timeline"`
	BeganAt  time.Time `json:"began_at"`
	Lossless bool      `json:"lossless"`
	Reason   string    `json:"reason"`
}

// CurrentEra returns the era the server is in, settling it first if this
// is the first transaction of a new one.
func CurrentEra(ctx context.Context, db DBTX) (Era, error) {
	var e Era
	if err := db.QueryRow(ctx, "select era, timeline, began_at, lossless, reason from fence.current_era()").Scan(&e.Era, &e.Timeline, &e.BeganAt, &e.Lossless, &e.Reason); err != nil {
		return Era{}, fmt.Errorf("current era: %w", FromPostgres(err))
	}
	return e, nil
}

// NewEra starts a new era now (fence.new_era, an administrator's): every
// generation issued before is void, every lease free. The runbook's step
// after restoring a backup or any copy as the primary, which the database
// cannot tell from a crash restart.
func NewEra(ctx context.Context, db DBTX, reason string) (Era, error) {
	err := confirmed(ctx, db, func(db DBTX) error {
		_, err := db.Exec(ctx, "select fence.new_era($1::pg_catalog.text)", reason)
		return err
	})
	if err != nil {
		return Era{}, fmt.Errorf("new era: %w", FromPostgres(err))
	}
	return CurrentEra(ctx, db)
}
