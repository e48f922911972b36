package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// openPTY opens a pseudo-terminal and returns its terminal side.
func openPTY(t *testing.T) *os.File {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestLogFormat(t *testing.T) {
	tty := openPTY(t)
	pipe, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pipe.Close()
	defer w.Close()
	for _, tt := range []struct {
		format string
		json   bool
		w      io.Writer
		want   string
	}{
		{"auto", false, tty, "text"},
		{"auto", true, tty, "json"},
		{"auto", false, w, "json"},
		{"", false, &bytes.Buffer{}, "json"},
		{"text", false, w, "text"},
		{"JSON", false, tty, "json"},
	} {
		got, err := logFormat(tt.format, tt.json, tt.w)
		if err != nil || got != tt.want {
			t.Errorf("logFormat(%q, json %v, %T) = %q, %v; want %q", tt.format, tt.json, tt.w, got, err, tt.want)
		}
	}
	if _, err := logFormat("xml", false, tty); err == nil {
		t.Error("log format xml accepted")
	}
}

// JSON lines carry units in their field names and ISO 8601 times; text
// lines are one a line.
func TestLoggerEncodings(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(zap.NewAtomicLevelAt(zap.InfoLevel), "json", &buf)
	log.Error("session closed", zap.Float64("duration_ms", 1.5), zap.Duration("took", 2*time.Second))
	var e map[string]any
	if err := json.Unmarshal(buf.Bytes(), &e); err != nil {
		t.Fatalf("%q: %v", buf.String(), err)
	}
	if e["msg"] != "session closed" || e["level"] != "error" || e["duration_ms"] != 1.5 || e["took"] != "2s" {
		t.Errorf("json entry %v", e)
	}
	if _, err := time.Parse("2006-01-02T15:04:05.000Z0700", e["ts"].(string)); err != nil {
		t.Errorf("ts %v: %v", e["ts"], err)
	}
	if _, ok := e["stacktrace"]; ok {
		t.Error("an error entry carries a stack trace")
	}
	buf.Reset()
	log = newLogger(zap.NewAtomicLevelAt(zap.InfoLevel), "text", &buf)
	log.Error("reload failed", zap.String("error", "bad"))
	if line := buf.String(); strings.Count(line, "\n") != 1 || !strings.Contains(line, "ERROR  reload failed") {
		t.Errorf("text entry %q", line)
	}
}
