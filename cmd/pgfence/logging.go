package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"
)

// Logs go to stderr: human-readable text on a terminal, one JSON object
// a line otherwise (a pipe, a file, journald), or as --log-format says.
// Field names carry their unit (duration_ms, grace_ms); times are ISO
// 8601; no stack traces (an error is one line that says what went wrong).

// logFormat resolves "auto", "text" or "json" for w; asJSON (the --json
// flag) makes auto JSON.
func logFormat(format string, asJSON bool, w io.Writer) (string, error) {
	switch f := strings.ToLower(strings.TrimSpace(format)); f {
	case "text", "json":
		return f, nil
	case "", "auto":
		if asJSON || !isTerminal(w) {
			return "json", nil
		}
		return "text", nil
	}
	return "", fmt.Errorf("log format %q: want text, json or auto", format)
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// newLogger logs at level to w in format ("text" or "json").
func newLogger(level zap.AtomicLevel, format string, w io.Writer) *zap.Logger {
	ec := zapcore.EncoderConfig{
		TimeKey:        "ts",
		LevelKey:       "level",
		NameKey:        "logger",
		MessageKey:     "msg",
		LineEnding:     zapcore.DefaultLineEnding,
		EncodeLevel:    zapcore.LowercaseLevelEncoder,
		EncodeTime:     zapcore.ISO8601TimeEncoder,
		EncodeDuration: zapcore.StringDurationEncoder,
		EncodeName:     zapcore.FullNameEncoder,
	}
	var enc zapcore.Encoder
	if format == "text" {
		ec.EncodeLevel = zapcore.CapitalLevelEncoder
		ec.ConsoleSeparator = "  "
		enc = zapcore.NewConsoleEncoder(ec)
	} else {
		enc = zapcore.NewJSONEncoder(ec)
	}
	ws := zapcore.Lock(zapcore.AddSync(w))
	return zap.New(zapcore.NewCore(enc, ws, level), zap.ErrorOutput(ws))
}

// buildLogger is the logger at lvl in format (text, json or auto: text on
// a terminal, JSON otherwise or with --json) to w, and its level, which
// serve changes on a reload.
func buildLogger(lvl, format string, asJSON bool, w io.Writer) (*zap.Logger, zap.AtomicLevel, error) {
	level, err := zapcore.ParseLevel(lvl)
	if err != nil {
		return nil, zap.AtomicLevel{}, fmt.Errorf("--log-level: %w", err)
	}
	f, err := logFormat(format, asJSON, w)
	if err != nil {
		return nil, zap.AtomicLevel{}, fmt.Errorf("--log-format: %w", err)
	}
	al := zap.NewAtomicLevelAt(level)
	return newLogger(al, f, w), al, nil
}

// commandLogger is the logger of a command that is not serve (serve reads
// log_level and log_format with the rest of its configuration): the root
// --log-level and --log-format, to the command's stderr.
func commandLogger(cmd *cobra.Command) (*zap.Logger, error) {
	level, format := "info", "auto"
	if f := cmd.Flag("log-level"); f != nil {
		level = f.Value.String()
	}
	if f := cmd.Flag("log-format"); f != nil {
		format = f.Value.String()
	}
	log, _, err := buildLogger(level, format, jsonFlag(cmd), cmd.ErrOrStderr())
	return log, err
}
