package session

import (
	"errors"
	"fmt"

	"github.com/pgfence/pgfence/fence"
)

// SQLSTATE codes of this package's errors, each a *fence.Error.
const (
	CodeInvalidParameterValue = "22023" // invalid_parameter_value
	CodeFeatureNotSupported   = "0A000" // feature_not_supported
	CodeInFailedTransaction   = "25P02" // in_failed_sql_transaction
	CodeNoActiveTransaction   = "25P01" // no_active_sql_transaction
	CodeInvalidSavepoint      = "3B001" // invalid_savepoint_specification
	CodeInvalidStatementName  = "26000" // invalid_sql_statement_name
)

// ErrOutOfSync is returned by TxStatus when the server's transaction status
// contradicts the tracked one. The State has been forced to the server's
// status; the proxy should log it (a classification or wiring bug).
var ErrOutOfSync = errors.New("session: transaction state out of sync with server")

// errUncertain is the cause of resolve's "cannot be known" (see
// isUncertain): Check lets such a statement pass.
var errUncertain = errors.New("session: the effect cannot be known")

func invalid(format string, args ...any) *fence.Error {
	return &fence.Error{Code: CodeInvalidParameterValue, Message: fmt.Sprintf(format, args...)}
}
