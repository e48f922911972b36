package proxy

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Errors callers can branch on.
var (
	// ErrServerClosed is returned by Serve after Shutdown.
	ErrServerClosed = errors.New("proxy: server closed")
	// ErrTooManyClients is logged when a client is refused for MaxClients.
	ErrTooManyClients = errors.New("too many clients")
)

// errorResponse is the one place internal errors become messages for the
// client. Details that help an operator but not the user stay in the log.
func errorResponse(err error) *pgproto3.ErrorResponse {
	var pe *ProtocolError
	var pg *pgconn.PgError
	switch {
	case errors.As(err, &pg):
		// An upstream refusal (bad database, upstream auth, too many
		// connections upstream): pass PostgreSQL's own words on.
		return &pgproto3.ErrorResponse{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: pg.Code, Message: pg.Message, Detail: pg.Detail, Hint: pg.Hint}
	case errors.As(err, &pe):
		e := fatal(pe.Code, pe.Msg)
		e.Hint = pe.Hint
		return e
	default:
		return fatal("08006", "pgfence: upstream connection failed")
	}
}

func fatal(code, msg string) *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: code, Message: msg}
}

// encode appends a backend message; pgproto3 encoders only fail on
// impossible sizes, which our messages never reach.
func encode(dst []byte, m pgproto3.BackendMessage) []byte {
	out, err := m.Encode(dst)
	if err != nil {
		return dst
	}
	return out
}
