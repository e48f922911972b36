package proxy

import (
	"fmt"
	"net"
	"slices"

	"github.com/jackc/pgx/v5/pgproto3"
)

// consoleRole is what a console user may do.
type consoleRole int

const (
	// roleStats may run the SHOW commands and sees no fencing tokens
	// (PgBouncer's stats_users).
	roleStats consoleRole = iota + 1
	// roleAdmin may run every command and sees the tokens (PgBouncer's
	// admin_users).
	roleAdmin
)

func (r consoleRole) String() string {
	if r == roleAdmin {
		return "admin"
	}
	return "stats"
}

// consoleLogin authenticates a console client on c as user, with the
// console's own users file (Config.ConsoleUsers), whatever the clients'
// authentication method is, and returns its role. The startup packet's
// user is the identity: the name in the client's SCRAM message, a SCRAM
// authorization identity and startup parameters such as role or options
// change nothing. On failure the caller sends the error to the client:
//
//   - 28000: the console has no users file;
//   - 28P01: an unknown user, a wrong password, a user without a
//     verifier (the same exchange and message for all three);
//   - 42501: authenticated, but in neither admin_users nor stats_users;
//   - 08P01: a malformed or missing authentication response.
func (s *Server) consoleLogin(c net.Conn, user string) (consoleRole, error) {
	live := s.live()
	if len(live.consoleUsers) == 0 {
		return 0, &ProtocolError{Code: "28000",
			Msg: "the pgfence admin console has no users: set console_auth_file (Config.ConsoleUsers) to a file of SCRAM verifiers (pgfence passwd) and list its users in admin_users or stats_users; see docs/console.md"}
	}
	verifier, known := live.consoleUsers[user]
	sc, err := parseVerifier(verifier)
	if !known || err != nil {
		sc, known = s.dummyCredentials(user), false
	}
	be := NewAuthBackend(c)
	if _, err := SCRAMExchange(be, user, sc, known, s.channelBinding(c)); err != nil {
		return 0, err
	}
	be.Send(&pgproto3.AuthenticationOk{})
	if err := be.Flush(); err != nil {
		return 0, err
	}
	switch {
	case slices.Contains(live.admins, user):
		return roleAdmin, nil
	case slices.Contains(live.stats, user):
		return roleStats, nil
	}
	return 0, &ProtocolError{Code: "42501", Msg: fmt.Sprintf("permission denied: user %q is neither in admin_users nor in stats_users of the pgfence console", user)}
}

// errAdminOnly is the answer to a stats user's admin command.
func errAdminOnly(stmt string) *pgproto3.ErrorResponse {
	return adminError("42501", fmt.Sprintf("admin access needed for %q: the console user is a stats user (stats_users), not in admin_users", stmt), "")
}
