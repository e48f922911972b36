package chaos

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/pgfence/pgfence/audit"
)

// Attempt is one line of a worker's record file: one attempt at one commit,
// and the outcome the worker saw (audit.Outcome*). Before each attempt the
// worker writes a marker line with no Outcome (only Began): the nemesis
// reads it to tell a worker in the middle of an attempt from one between
// attempts. readAttempts skips markers; recordLines keeps them on request.
type Attempt struct {
	Worker  string    `json:"worker"`
	Job     string    `json:"job"`
	Epoch   int64     `json:"epoch"`
	Token   int64     `json:"token"`
	Step    string    `json:"step"`
	Digest  string    `json:"digest,omitempty"` // hex; empty when the proxy computed it
	Outcome string    `json:"outcome"`
	Code    string    `json:"code,omitempty"` // SQLSTATE of the error, if any
	Probe   bool      `json:"probe,omitempty"`
	Retry   int       `json:"retry"` // 0 for the first attempt of a commit
	Detail  string    `json:"detail,omitempty"`
	Began   time.Time `json:"began"` // before the attempt's first message
	At      time.Time `json:"at"`    // once its outcome was known
}

// marker reports whether a is the line written before an attempt.
func (a Attempt) marker() bool { return a.Outcome == "" }

// recorder appends attempts to a JSON-lines file, one write per line, so a
// worker killed at any moment leaves only whole lines behind.
type recorder struct {
	f *os.File
}

func openRecorder(path string) (*recorder, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open records: %w", err)
	}
	return &recorder{f: f}, nil
}

func (r *recorder) add(a Attempt) error {
	b, err := json.Marshal(a)
	if err != nil {
		return err
	}
	if _, err := r.f.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("write record: %w", err)
	}
	return nil
}

func (r *recorder) close() error { return r.f.Close() }

// readAttempts reads every *.jsonl file in dir, in time order. A torn last
// line (a worker killed mid-write) is skipped.
func readAttempts(dir string) ([]Attempt, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.jsonl"))
	if err != nil {
		return nil, err
	}
	var out []Attempt
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", name, err)
		}
		out = append(out, parseRecords(b, false)...)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At.Before(out[j].At) })
	return out, nil
}

// parseRecords parses the lines of a record file, skipping a torn line,
// and the markers written before each attempt unless markers is set.
func parseRecords(b []byte, markers bool) []Attempt {
	var out []Attempt
	for line := range bytes.Lines(b) {
		var a Attempt
		if json.Unmarshal(line, &a) == nil && (markers || !a.marker()) {
			out = append(out, a)
		}
	}
	return out
}

// clientRecords turns attempts into the checker's client records.
func clientRecords(as []Attempt) []audit.ClientRecord {
	out := make([]audit.ClientRecord, 0, len(as))
	for _, a := range as {
		var d []byte
		if a.Digest != "" {
			d, _ = hex.DecodeString(a.Digest)
		}
		out = append(out, audit.ClientRecord{
			Job: a.Job, Epoch: a.Epoch, Token: a.Token, Step: a.Step,
			Digest: d, Outcome: a.Outcome, At: a.At,
		})
	}
	return out
}
