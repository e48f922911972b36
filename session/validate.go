package session

import (
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/pgfence/pgfence/fence"
)

// The fence GUCs (DESIGN.md §3).
const (
	JobKey        = "fence.job_key"
	Epoch         = "fence.epoch"
	Token         = "fence.token"
	Step          = "fence.step"
	PayloadDigest = "fence.payload_digest"
	ReadPolicy    = "fence.read_policy"
	ReadWait      = "fence.read_wait"
	MinLSN        = "fence.min_lsn"
	SearchPath    = "search_path"
)

// Tracked reports whether a parameter (lowercase) is tracked: every fence.*
// name and search_path.
func Tracked(name string) bool {
	return strings.HasPrefix(name, "fence.") || name == SearchPath
}

// Validate checks a value for a tracked parameter, as SET would. An empty
// value is always accepted: it means "not set" (RESET gives a fence.*
// placeholder the empty value too). Rules:
//
//   - fence.token, fence.epoch: a decimal integer from 1 to 2^63-1 (optional
//     sign "+" and surrounding spaces, as bigint input allows); tokens and
//     epochs come from sequences starting at 1, so 0 and negatives are refused.
//   - fence.job_key: at most 200 characters.
//   - fence.step: at most 200 characters.
//   - fence.payload_digest: 64 hexadecimal digits (a SHA-256).
//   - fence.read_policy: primary, wait or pending.
//   - fence.read_wait: a non-negative duration: "500ms", "2s", "1.5 min",
//     "1m30s", or a bare number of milliseconds.
//   - fence.min_lsn: a WAL position such as 16/B374D848.
//
// Other fence.* names and search_path are not validated here (PostgreSQL
// checks search_path's syntax itself).
func Validate(name, value string) error {
	if value == "" {
		return nil
	}
	switch name {
	case Token, Epoch:
		if _, err := parsePositive(value); err != nil {
			return &fence.Error{Code: CodeInvalidParameterValue,
				Message: "invalid value for parameter \"" + name + "\": \"" + value + "\"",
				Hint:    name + " must be a positive integer (1 to 9223372036854775807), as returned by fence.acquire"}
		}
	case JobKey, Step:
		if n := utf8.RuneCountInString(value); n > 200 {
			return &fence.Error{Code: CodeInvalidParameterValue,
				Message: "value for parameter \"" + name + "\" is too long (" + strconv.Itoa(n) + " characters)",
				Hint:    name + " must be at most 200 characters"}
		}
	case PayloadDigest:
		if len(value) != 64 || strings.IndexFunc(value, notHex) >= 0 {
			return &fence.Error{Code: CodeInvalidParameterValue,
				Message: "invalid value for parameter \"" + name + "\": \"" + value + "\"",
				Hint:    name + " must be 64 hexadecimal digits (a SHA-256 digest)"}
		}
	case ReadPolicy:
		switch strings.ToLower(value) {
		case "primary", "wait", "pending":
		default:
			return &fence.Error{Code: CodeInvalidParameterValue,
				Message: "invalid value for parameter \"" + name + "\": \"" + value + "\"",
				Hint:    "available values: primary, wait, pending"}
		}
	case ReadWait:
		if _, err := ParseDuration(value); err != nil {
			return &fence.Error{Code: CodeInvalidParameterValue,
				Message: "invalid value for parameter \"" + name + "\": \"" + value + "\"",
				Hint:    name + ` must be a duration such as "500ms", "2s" or "1min"`}
		}
	case MinLSN:
		if _, err := ParseLSN(value); err != nil {
			return &fence.Error{Code: CodeInvalidParameterValue,
				Message: "invalid value for parameter \"" + name + "\": \"" + value + "\"",
				Hint:    name + " must be a WAL position such as 16/B374D848 (pg_current_wal_lsn())"}
		}
	}
	return nil
}

func notHex(r rune) bool {
	return !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f' || r >= 'A' && r <= 'F')
}

func parsePositive(s string) (int64, error) {
	t := strings.TrimSpace(s)
	t = strings.TrimPrefix(t, "+")
	if t == "" || strings.IndexFunc(t, func(r rune) bool { return r < '0' || r > '9' }) >= 0 {
		return 0, strconv.ErrSyntax
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil {
		return 0, err
	}
	if n <= 0 {
		return 0, strconv.ErrRange
	}
	return n, nil
}

// ParseDuration parses a fence.read_wait value: a PostgreSQL time setting
// ("500ms", "2 s", "1.5min", "1h", "1d", "100us", or a bare number of
// milliseconds) or a Go duration ("1m30s"). Negative durations are refused.
func ParseDuration(s string) (time.Duration, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && (t[i] >= '0' && t[i] <= '9' || t[i] == '.') {
		i++
	}
	if i > 0 {
		num, err := strconv.ParseFloat(t[:i], 64)
		if err == nil {
			unit := strings.TrimSpace(t[i:])
			scale := map[string]time.Duration{
				"": time.Millisecond, "us": time.Microsecond, "ms": time.Millisecond,
				"s": time.Second, "min": time.Minute, "h": time.Hour, "d": 24 * time.Hour,
			}
			if d, ok := scale[unit]; ok {
				v := num * float64(d)
				if v > float64(1<<62) {
					return 0, strconv.ErrRange
				}
				return time.Duration(v), nil
			}
		}
	}
	d, err := time.ParseDuration(t)
	if err != nil {
		return 0, err
	}
	if d < 0 {
		return 0, strconv.ErrRange
	}
	return d, nil
}

// ParseLSN parses a WAL position "X/Y" (hexadecimal, up to 8 digits each)
// into its 64-bit value.
func ParseLSN(s string) (uint64, error) {
	hi, lo, ok := strings.Cut(s, "/")
	if !ok || len(hi) == 0 || len(hi) > 8 || len(lo) == 0 || len(lo) > 8 {
		return 0, strconv.ErrSyntax
	}
	h, err := strconv.ParseUint(hi, 16, 32)
	if err != nil {
		return 0, err
	}
	l, err := strconv.ParseUint(lo, 16, 32)
	if err != nil {
		return 0, err
	}
	return h<<32 | l, nil
}
