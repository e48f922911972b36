package session

import (
	"errors"
	"fmt"
)

// SQLSTATE codes used by this package.
const (
	CodeInvalidParameterValue = "22023" // invalid_parameter_value
	CodeFeatureNotSupported   = "0A000" // feature_not_supported
	CodeInFailedTransaction   = "25P02" // in_failed_sql_transaction
	CodeNoActiveTransaction   = "25P01" // no_active_sql_transaction
	CodeInvalidSavepoint      = "3B001" // invalid_savepoint_specification
	CodeInvalidStatementName  = "26000" // invalid_sql_statement_name
)

// Error is an error the proxy should report to the client as an
// ErrorResponse with this SQLSTATE.
type Error struct {
	Code    string
	Message string
	Hint    string

	uncertain bool // resolve: the effect cannot be known (Check lets it pass)
}

func (e *Error) Error() string {
	if e.Hint != "" {
		return fmt.Sprintf("%s (SQLSTATE %s; %s)", e.Message, e.Code, e.Hint)
	}
	return fmt.Sprintf("%s (SQLSTATE %s)", e.Message, e.Code)
}

// SQLState returns the error's SQLSTATE code.
func (e *Error) SQLState() string { return e.Code }

// ErrOutOfSync is returned by TxStatus when the server's transaction status
// contradicts the tracked one. The State has been forced to the server's
// status; the proxy should log it (a classification or wiring bug).
var ErrOutOfSync = errors.New("session: transaction state out of sync with server")

func invalid(format string, args ...any) *Error {
	return &Error{Code: CodeInvalidParameterValue, Message: fmt.Sprintf(format, args...)}
}
