package clientenc

//go:generate go run ./gen

// PostgreSQL's rules for splitting and checking client text, from
// src/common/wchar.c (pg_*_mblen and pg_*_verifychar). b starts at a
// byte >= 0x80; ASCII bytes are always single characters.

const (
	ss2 = 0x8e // EUC single shift 2
	ss3 = 0x8f // EUC single shift 3
)

func eucRange(c byte) bool { return c >= 0xa1 && c <= 0xfe }

func sjisHead(c byte) bool { return c >= 0x81 && c <= 0x9f || c >= 0xe0 && c <= 0xfc }
func sjisTail(c byte) bool { return c >= 0x40 && c <= 0x7e || c >= 0x80 && c <= 0xfc }

// mblen is the length PostgreSQL gives the character b starts with.
func mblen(id ID, b []byte) int {
	c := b[0]
	if c < 0x80 {
		return 1
	}
	switch id {
	case UTF8:
		switch {
		case c&0xe0 == 0xc0:
			return 2
		case c&0xf0 == 0xe0:
			return 3
		case c&0xf8 == 0xf0:
			return 4
		}
		return 1
	case EUCJP, EUCJIS2004, EUCKR, JOHAB:
		switch c {
		case ss2:
			return 2
		case ss3:
			return 3
		}
		return 2
	case EUCCN, BIG5, GBK, UHC:
		return 2
	case EUCTW:
		switch c {
		case ss2:
			return 4
		case ss3:
			return 3
		}
		return 2
	case MuleInternal:
		switch {
		case c >= 0x81 && c <= 0x8d:
			return 2
		case c == 0x9a || c == 0x9b:
			return 3
		case c >= 0x90 && c <= 0x99:
			return 3
		case c == 0x9c || c == 0x9d:
			return 4
		}
		return 1
	case SJIS, ShiftJIS2004:
		if c >= 0xa1 && c <= 0xdf {
			return 1 // half-width katakana
		}
		return 2
	case GB18030:
		if len(b) > 1 && b[1] >= 0x30 && b[1] <= 0x39 {
			return 4
		}
		return 2
	}
	return 1 // single-byte encodings
}

// verify returns the length of the valid character b starts with, or -1.
func verify(id ID, b []byte) int {
	n := mblen(id, b)
	if n > len(b) {
		return -1
	}
	for _, x := range b[1:n] {
		if x == 0 {
			return -1
		}
	}
	c := b[0]
	switch id {
	case UTF8:
		if !utf8Legal(b[:n]) {
			return -1
		}
	case EUCJP, EUCJIS2004:
		switch c {
		case ss2:
			if b[1] < 0xa1 || b[1] > 0xdf {
				return -1
			}
		case ss3:
			if !eucRange(b[1]) || !eucRange(b[2]) {
				return -1
			}
		default:
			if !eucRange(c) || !eucRange(b[1]) {
				return -1
			}
		}
	case EUCKR, EUCCN:
		if !eucRange(c) || !eucRange(b[1]) {
			return -1
		}
	case EUCTW:
		switch c {
		case ss2:
			if b[1] < 0xa1 || b[1] > 0xa7 || !eucRange(b[2]) || !eucRange(b[3]) {
				return -1
			}
		case ss3:
			return -1
		default:
			if !eucRange(b[1]) {
				return -1
			}
		}
	case JOHAB:
		for _, x := range b[1:n] {
			if !eucRange(x) {
				return -1
			}
		}
	case MuleInternal:
		for _, x := range b[1:n] {
			if x < 0x80 {
				return -1
			}
		}
	case SJIS, ShiftJIS2004:
		if n == 2 && (!sjisHead(c) || !sjisTail(b[1])) {
			return -1
		}
	case GB18030:
		if n == 4 {
			if c < 0x81 || c > 0xfe || b[2] < 0x81 || b[2] > 0xfe || b[3] < 0x30 || b[3] > 0x39 {
				return -1
			}
		} else if c < 0x81 || c > 0xfe || !(b[1] >= 0x40 && b[1] <= 0x7e || b[1] >= 0x80 && b[1] <= 0xfe) {
			return -1
		}
	}
	// BIG5, GBK, UHC: PostgreSQL checks only that the bytes are there and
	// not zero. Single-byte encodings accept every byte.
	return n
}

// utf8Legal is pg_utf8_islegal: RFC 3629, no overlong forms, no
// surrogates, nothing above U+10FFFF.
func utf8Legal(s []byte) bool {
	switch len(s) {
	case 4:
		if s[3] < 0x80 || s[3] > 0xbf {
			return false
		}
		fallthrough
	case 3:
		if s[2] < 0x80 || s[2] > 0xbf {
			return false
		}
		fallthrough
	case 2:
		// The second byte's range, narrower after the lead bytes that
		// could otherwise start an overlong form (e0, f0), a surrogate
		// (ed) or a code point above U+10FFFF (f4).
		lo, hi := byte(0x80), byte(0xbf)
		switch s[0] {
		case 0xe0:
			lo = 0xa0
		case 0xed:
			hi = 0x9f
		case 0xf0:
			lo = 0x90
		case 0xf4:
			hi = 0x8f
		}
		if s[1] < lo || s[1] > hi {
			return false
		}
		fallthrough
	case 1:
		a := s[0]
		if a >= 0x80 && a < 0xc2 || a > 0xf4 {
			return false
		}
	default:
		return false
	}
	return true
}
