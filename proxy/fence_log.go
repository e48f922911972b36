package proxy

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
)

// The proxy says what it refused (issue 20): every refusal a client gets —
// the FN codes, whether the gate's own check, the backstop or the receipt
// step raised them, and the proxy's fail-closed errors (text it cannot
// read, a reserved name, a malformed fence setting) — is one line at info,
// with what an operator needs to find the client and the job: the session,
// user, database, application_name, client address, the job key and the
// generation presented and current, the protected table, the SQLSTATE and
// the message. Replays are logged too (at info, "replayed"). The lines go
// through zap's sampler: per second, the first refusalBurst lines, then
// one in refusalThereafter, so a storm of refused zombies cannot flood the
// log; FenceStats.RefusalsNotLogged counts what it left out.

const (
	refusalBurst      = 20
	refusalThereafter = 100
)

// refusalLogger is log sampled for refusal lines, counting the dropped.
func refusalLogger(log *zap.Logger, dropped *atomic.Int64) *zap.Logger {
	return log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, refusalBurst, refusalThereafter,
			zapcore.SamplerHook(func(_ zapcore.Entry, d zapcore.SamplingDecision) {
				if d&zapcore.LogDropped != 0 {
					dropped.Add(1)
				}
			}))
	}))
}

// currentRE finds the current generation in the fence functions'
// messages ("... current epoch 3, token 18)", "current token 18").
var currentRE = regexp.MustCompile(`current (?:epoch (\d+),? )?token (\d+)`)

// logRefusal logs what the client was refused (e) for stmt (nil when the
// refusal is not about one statement, e.g. a COMMIT's receipt step).
// Callers hold h.mu.
func (h *fenceSession) logRefusal(s gateConn, e *pgproto3.ErrorResponse, stmt *rewrite.Stmt, outcome string) {
	gen := h.st.Gate().Gen
	if !h.st.Gate().Gated {
		gen, _ = h.st.Generation()
	}
	fields := []zap.Field{
		zap.Uint32("session", s.sessionID()),
		zap.String("user", h.user),
		zap.String("database", h.db),
		zap.String("application_name", h.be.appName),
		zap.String("sqlstate", e.Code),
		zap.String("job_key", gen.JobKey),
		zap.Int64("epoch", gen.Epoch),
		zap.Int64("token", gen.Token),
		zap.String("step", gen.Step),
	}
	if m := currentRE.FindStringSubmatch(e.Message); m != nil {
		if m[1] != "" {
			n, _ := strconv.ParseInt(m[1], 10, 64)
			fields = append(fields, zap.Int64("current_epoch", n))
		}
		n, _ := strconv.ParseInt(m[2], 10, 64)
		fields = append(fields, zap.Int64("current_token", n))
	}
	if stmt != nil {
		var tables []string
		for _, r := range h.cat.prot.Load().ProtectedWrites(stmt, h.st.SearchPath()) {
			tables = append(tables, r.String())
		}
		if len(tables) > 0 {
			fields = append(fields, zap.String("table", strings.Join(tables, ",")))
		}
	}
	fields = append(fields, zap.String("message", e.Message))
	h.f.refusals.Info(outcome, fields...)
}

// setupError turns the server's error for a fence schema that is not
// there, or a role that may not use it (fence.Setup), into FN014 with the
// command that fixes it, and warns once per database (and role) in the
// proxy's log. It returns false for any other error.
func (h *fenceSession) setupError(s gateConn, e *pgproto3.ErrorResponse) bool {
	msg := e.Message
	switch fence.Setup(e.Code, msg) {
	case fence.NoSchema:
		e.Message = fmt.Sprintf("pgfence: database %q has no (or an outdated) fence schema: %s", h.db, msg)
		e.Hint = fmt.Sprintf("a DBA runs: pgfence migrate --database 'postgres://<dba>@<host>/%s'", h.db)
		h.f.warnOnce("schema:"+h.db, "database has no usable fence schema; fenced clients are refused until `pgfence migrate` runs",
			zap.String("database", h.db), zap.String("error", msg))
	case fence.NotWorker:
		e.Message = fmt.Sprintf("pgfence: role %q may not use the fence schema in database %q: %s", h.user, h.db, msg)
		e.Hint = fmt.Sprintf("a DBA runs: GRANT pgfence_worker TO %s;", rewrite.QuoteIdentifier(h.user))
		h.f.warnOnce("role:"+h.db+"\x00"+h.user, "role lacks pgfence_worker; its fenced work is refused",
			zap.String("database", h.db), zap.String("user", h.user), zap.String("error", msg))
	default:
		return false
	}
	e.Code = fence.CodeNotInstalled
	e.Where = ""
	return true
}

// warnOnce logs a warning the first time key is seen.
func (f *Fence) warnOnce(key, msg string, fields ...zap.Field) {
	if _, seen := f.warned.LoadOrStore(key, true); !seen {
		f.log.Warn(msg, fields...)
	}
}
