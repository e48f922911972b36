package runner

import (
	"strconv"
	"strings"
	"time"
)

// escapeOption escapes a value for PGOPTIONS the way libpq splits it: the
// server splits the options string on whitespace, and a backslash makes
// the next character literal (so "\ " is a space and "\\" a backslash).
func escapeOption(v string) string {
	var b strings.Builder
	for _, r := range v {
		switch r {
		case '\\', ' ', '\t', '\n', '\r', '\f', '\v':
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// fenceOptions returns the "-c fence.job_key=… -c fence.epoch=… -c
// fence.token=…" part of PGOPTIONS for lease l.
func fenceOptions(l held) string {
	return "-c fence.job_key=" + escapeOption(l.JobKey) +
		" -c fence.epoch=" + strconv.FormatInt(l.Epoch, 10) +
		" -c fence.token=" + strconv.FormatInt(l.Token, 10)
}

// appendPGOptions appends the fence options to an existing PGOPTIONS
// value. Later -c options win in PostgreSQL, so a stale fence.* setting
// already present in the environment is overridden.
func appendPGOptions(existing string, l held) string {
	if strings.TrimSpace(existing) == "" {
		return fenceOptions(l)
	}
	return existing + " " + fenceOptions(l)
}

// childEnv returns env (KEY=value entries) with PGOPTIONS extended and the
// PGFENCE_* variables describing lease l set. Earlier definitions of these
// variables are removed so the command sees exactly one of each.
func childEnv(env []string, l held) []string {
	var pgoptions string
	out := make([]string, 0, len(env)+5)
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "PGOPTIONS":
			pgoptions = v
			continue
		case "PGFENCE_JOB_KEY", "PGFENCE_EPOCH", "PGFENCE_TOKEN", "PGFENCE_LEASE_EXPIRES_AT":
			continue
		}
		out = append(out, kv)
	}
	return append(out,
		"PGOPTIONS="+appendPGOptions(pgoptions, l),
		"PGFENCE_JOB_KEY="+l.JobKey,
		"PGFENCE_EPOCH="+strconv.FormatInt(l.Epoch, 10),
		"PGFENCE_TOKEN="+strconv.FormatInt(l.Token, 10),
		"PGFENCE_LEASE_EXPIRES_AT="+l.ExpiresAt.UTC().Format(time.RFC3339Nano),
	)
}
