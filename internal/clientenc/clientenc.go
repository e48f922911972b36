// Package clientenc reads the text a PostgreSQL client sends in its
// client_encoding, as the server would, and writes text back in it.
//
// The proxy classifies SQL with PostgreSQL's parser compiled for UTF-8, so
// a query sent in another encoding must be decoded first; decoding it
// wrongly would let the proxy see a different statement than the server
// runs. In SJIS, BIG5, GBK, UHC and GB18030 the second byte of a character
// may be an ASCII quote or backslash: read byte by byte, 0x95 0x5C is a
// character followed by a backslash, read as SJIS it is one character.
// So Decode first splits and checks the text with PostgreSQL's own rules
// (src/common/wchar.c: the length of a character from its first bytes,
// the valid ranges of the bytes that follow), then maps it to Unicode:
// single-byte encodings with PostgreSQL's own tables (single.go, generated
// from a PostgreSQL server: x/text's charmaps differ in places, the C1
// controls of ISO 8859 and KOI8-U's box characters among them), multi-byte
// ones with golang.org/x/text. Text PostgreSQL would refuse is refused
// (22021); a character that maps to nothing (a byte a table leaves
// undefined, a BIG5 pair with an ASCII second byte, which PostgreSQL
// splits as one character and cannot convert) is refused too (22P05), as
// the server would. x/text lacks EUC_TW, EUC_JIS_2004, MULE_INTERNAL,
// JOHAB and SHIFT_JIS_2004 (and SQL_ASCII in a SQL_ASCII database maps
// nothing): there each byte above 0x7F becomes a code point of its own in
// the private use area (U+F780 + byte - 0x80) — in all but SHIFT_JIS_2004
// such bytes never stand for ASCII, so the statement's structure is exact —
// and each two-byte SHIFT_JIS_2004 character, whose second byte may be
// ASCII, becomes one (U+F0000 + its two bytes). Encode restores the bytes.
//
// It is not a general converter: it knows only what PostgreSQL accepts
// from clients, and it has no opinion on what the server stores.
package clientenc

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/encoding"
	"golang.org/x/text/encoding/japanese"
	"golang.org/x/text/encoding/korean"
	"golang.org/x/text/encoding/simplifiedchinese"
	"golang.org/x/text/encoding/traditionalchinese"
)

// ID is a PostgreSQL encoding.
type ID uint8

// The encodings PostgreSQL accepts from clients, in pg_enc order.
const (
	SQLASCII ID = iota
	EUCJP
	EUCCN
	EUCKR
	EUCTW
	EUCJIS2004
	UTF8
	MuleInternal
	Latin1
	Latin2
	Latin3
	Latin4
	Latin5
	Latin6
	Latin7
	Latin8
	Latin9
	Latin10
	WIN1256
	WIN1258
	WIN866
	WIN874
	KOI8R
	WIN1251
	WIN1252
	ISO8859_5
	ISO8859_6
	ISO8859_7
	ISO8859_8
	WIN1250
	WIN1253
	WIN1254
	WIN1255
	WIN1257
	KOI8U
	SJIS
	BIG5
	GBK
	UHC
	GB18030
	JOHAB
	ShiftJIS2004
	numIDs
)

// names are the official names, as PostgreSQL reports them in
// ParameterStatus.
var names = [numIDs]string{
	"SQL_ASCII", "EUC_JP", "EUC_CN", "EUC_KR", "EUC_TW", "EUC_JIS_2004", "UTF8", "MULE_INTERNAL",
	"LATIN1", "LATIN2", "LATIN3", "LATIN4", "LATIN5", "LATIN6", "LATIN7", "LATIN8", "LATIN9", "LATIN10",
	"WIN1256", "WIN1258", "WIN866", "WIN874", "KOI8R", "WIN1251", "WIN1252",
	"ISO_8859_5", "ISO_8859_6", "ISO_8859_7", "ISO_8859_8",
	"WIN1250", "WIN1253", "WIN1254", "WIN1255", "WIN1257", "KOI8U",
	"SJIS", "BIG5", "GBK", "UHC", "GB18030", "JOHAB", "SHIFT_JIS_2004",
}

func (id ID) String() string {
	if id < numIDs {
		return names[id]
	}
	return fmt.Sprintf("encoding(%d)", id)
}

// aliases is pg_encname_tbl (src/common/encnames.c): every name
// PostgreSQL accepts, reduced to lowercase letters and digits.
var aliases = map[string]ID{
	"abc": WIN1258, "alt": WIN866, "big5": BIG5, "euccn": EUCCN, "eucjis2004": EUCJIS2004,
	"eucjp": EUCJP, "euckr": EUCKR, "euctw": EUCTW, "gb18030": GB18030, "gbk": GBK,
	"iso88591": Latin1, "iso885910": Latin6, "iso885913": Latin7, "iso885914": Latin8,
	"iso885915": Latin9, "iso885916": Latin10, "iso88592": Latin2, "iso88593": Latin3,
	"iso88594": Latin4, "iso88595": ISO8859_5, "iso88596": ISO8859_6, "iso88597": ISO8859_7,
	"iso88598": ISO8859_8, "iso88599": Latin5, "johab": JOHAB, "koi8": KOI8R, "koi8r": KOI8R,
	"koi8u": KOI8U, "latin1": Latin1, "latin10": Latin10, "latin2": Latin2, "latin3": Latin3,
	"latin4": Latin4, "latin5": Latin5, "latin6": Latin6, "latin7": Latin7, "latin8": Latin8,
	"latin9": Latin9, "mskanji": SJIS, "muleinternal": MuleInternal, "shiftjis": SJIS,
	"shiftjis2004": ShiftJIS2004, "sjis": SJIS, "sqlascii": SQLASCII, "tcvn": WIN1258,
	"tcvn5712": WIN1258, "uhc": UHC, "unicode": UTF8, "utf8": UTF8, "vscii": WIN1258,
	"win": WIN1251, "win1250": WIN1250, "win1251": WIN1251, "win1252": WIN1252,
	"win1253": WIN1253, "win1254": WIN1254, "win1255": WIN1255, "win1256": WIN1256,
	"win1257": WIN1257, "win1258": WIN1258, "win866": WIN866, "win874": WIN874,
	"win932": SJIS, "win936": GBK, "win949": UHC, "win950": BIG5,
	"windows1250": WIN1250, "windows1251": WIN1251, "windows1252": WIN1252,
	"windows1253": WIN1253, "windows1254": WIN1254, "windows1255": WIN1255,
	"windows1256": WIN1256, "windows1257": WIN1257, "windows1258": WIN1258,
	"windows866": WIN866, "windows874": WIN874, "windows932": SJIS, "windows936": GBK,
	"windows949": UHC, "windows950": BIG5,
}

// Lookup finds an encoding by any name PostgreSQL accepts for it
// ("UTF8", "utf-8", "Latin1", "ISO_8859_1", "win1252", ...): case and
// every character other than a letter or a digit are ignored, as
// PostgreSQL's clean_encoding_name does.
func Lookup(name string) (ID, bool) {
	var b strings.Builder
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c >= 'A' && c <= 'Z':
			b.WriteByte(c + 'a' - 'A')
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
			b.WriteByte(c)
		}
	}
	id, ok := aliases[b.String()]
	return id, ok
}

// xtext is the x/text codec of a multi-byte encoding, or nil.
func xtext(id ID) encoding.Encoding {
	switch id {
	case EUCJP:
		return japanese.EUCJP
	case SJIS:
		return japanese.ShiftJIS
	case EUCCN, GBK:
		return simplifiedchinese.GBK // EUC_CN's byte pairs are GBK's
	case GB18030:
		return simplifiedchinese.GB18030
	case EUCKR, UHC:
		return korean.EUCKR // WHATWG's EUC-KR is UHC (code page 949)
	case BIG5:
		return traditionalchinese.Big5
	}
	return nil
}

// mapping is how a Codec maps characters.
type mapping uint8

const (
	mapUTF8   mapping = iota // nothing to map
	mapSingle                // PostgreSQL's own table (single.go)
	mapXText                 // golang.org/x/text
	mapRaw                   // each byte above 0x7F to U+F780 + byte - 0x80
	mapPairs                 // SHIFT_JIS_2004: two-byte characters to U+F0000 + bytes, others as mapRaw
)

// The private-use mappings: byte 0x80 is rawBase; the two-byte character
// 0xXXYY is pairBase + 0xXXYY (supplementary private use area A).
const (
	rawBase  = 0xF780
	pairBase = 0xF0000
)

// Codec reads and writes one session's text. The zero value is not
// usable; see New.
type Codec struct {
	client ID // what the client said it sends
	rules  ID // what its text is checked as: the client's, or for SQL_ASCII the database's
	m      mapping
	table  *[128]rune        // mapSingle
	inv    map[rune]byte     // mapSingle: table inverted
	x      encoding.Encoding // mapXText
}

// New returns the codec for a session whose client_encoding is client in
// a database whose server_encoding is server (both as PostgreSQL reports
// them, or any alias). A client in SQL_ASCII sends text that PostgreSQL
// does not convert but checks as the database's encoding; in a SQL_ASCII
// database it checks nothing.
func New(client, server string) (*Codec, error) {
	c, ok := Lookup(client)
	if !ok {
		return nil, fmt.Errorf("unknown client_encoding %q", client)
	}
	s, ok := Lookup(server)
	if !ok {
		return nil, fmt.Errorf("unknown server_encoding %q", server)
	}
	cd := &Codec{client: c, rules: c}
	if c == SQLASCII {
		cd.rules = s
	}
	switch {
	case cd.rules == UTF8:
		cd.m = mapUTF8
	case single[cd.rules] != nil:
		cd.m, cd.table, cd.inv = mapSingle, single[cd.rules], inverses[cd.rules]
	case cd.rules == ShiftJIS2004:
		cd.m = mapPairs
	case xtext(cd.rules) != nil:
		cd.m, cd.x = mapXText, xtext(cd.rules)
	default:
		cd.m = mapRaw // SQL_ASCII databases, EUC_TW, EUC_JIS_2004, MULE_INTERNAL, JOHAB
	}
	return cd, nil
}

// inverses are the tables of single, inverted.
var inverses = func() map[ID]map[rune]byte {
	out := make(map[ID]map[rune]byte, len(single))
	for id, t := range single {
		m := make(map[rune]byte, 128)
		for i, r := range t {
			if r != 0 {
				m[r] = byte(0x80 + i)
			}
		}
		out[id] = m
	}
	return out
}()

// Client is the client_encoding the codec reads.
func (c *Codec) Client() ID { return c.client }

// IsUTF8 reports whether the client's text is UTF-8 already (Decode only
// checks it).
func (c *Codec) IsUTF8() bool { return c.m == mapUTF8 }

// Error is text the server would refuse: Code is 22021
// (character_not_in_repertoire: an invalid byte sequence) or 22P05
// (untranslatable_character).
type Error struct {
	Code    string
	Message string
}

func (e *Error) Error() string { return e.Message }

// Decode returns b as UTF-8, or an *Error for text PostgreSQL would refuse.
func (c *Codec) Decode(b []byte) (string, error) {
	if ascii(b) {
		return string(b), nil
	}
	if c.rules != SQLASCII {
		for i := 0; i < len(b); {
			if b[i] < 0x80 {
				i++
				continue
			}
			n := verify(c.rules, b[i:])
			if n < 0 {
				return "", c.invalid(b[i:])
			}
			i += n
		}
	}
	switch c.m {
	case mapUTF8:
		return string(b), nil
	case mapSingle:
		var sb strings.Builder
		sb.Grow(len(b) * 2)
		for _, x := range b {
			if x < 0x80 {
				sb.WriteByte(x)
				continue
			}
			r := c.table[x-0x80]
			if r == 0 {
				return "", c.untranslatable([]byte{x})
			}
			sb.WriteRune(r)
		}
		return sb.String(), nil
	case mapRaw, mapPairs:
		var sb strings.Builder
		sb.Grow(len(b) * 3)
		for i := 0; i < len(b); {
			x := b[i]
			switch {
			case x < 0x80:
				sb.WriteByte(x)
				i++
			case c.m == mapPairs && mblen(c.rules, b[i:]) == 2:
				sb.WriteRune(pairBase + rune(x)<<8 | rune(b[i+1]))
				i += 2
			default:
				sb.WriteRune(rawBase + rune(x) - 0x80)
				i++
			}
		}
		return sb.String(), nil
	}
	// Character by character, as PostgreSQL splits them (verify): x/text
	// splits some text otherwise (GBK's 0x80 is a character of its own
	// there, the first byte of a pair for PostgreSQL, which then finds
	// no character for the pair and refuses the text). Each character
	// must be one that maps to exactly one rune.
	dec := c.x.NewDecoder()
	var sb strings.Builder
	sb.Grow(len(b) * 2)
	var buf [16]byte
	for i := 0; i < len(b); {
		x := b[i]
		if x < 0x80 {
			sb.WriteByte(x)
			i++
			continue
		}
		n := verify(c.rules, b[i:]) // > 0: checked above
		ch := b[i : i+n]
		dec.Reset()
		nd, _, err := dec.Transform(buf[:], ch, true)
		r, size := utf8.DecodeRune(buf[:nd])
		if err != nil || nd == 0 || size != nd || r < 0x80 || r == utf8.RuneError && !(c.rules == GB18030 && gb18030HasFFFD(ch)) {
			return "", c.untranslatable(ch)
		}
		sb.Write(buf[:nd])
		i += n
	}
	return sb.String(), nil
}

// Encode returns s (UTF-8) in the client's encoding: the inverse of
// Decode for text Decode returned, and for ASCII text.
func (c *Codec) Encode(s string) ([]byte, error) {
	if c.m == mapUTF8 || asciiString(s) {
		return []byte(s), nil
	}
	if c.m == mapXText {
		b, err := c.x.NewEncoder().Bytes([]byte(s))
		if err != nil {
			return nil, &Error{Code: "22P05", Message: fmt.Sprintf("text has no equivalent in encoding %q: %v", c.client.String(), err)}
		}
		return b, nil
	}
	out := make([]byte, 0, len(s))
	for _, r := range s {
		switch {
		case r < 0x80:
			out = append(out, byte(r))
		case c.m == mapSingle && c.inv[r] != 0:
			out = append(out, c.inv[r])
		case c.m != mapSingle && r >= rawBase && r < rawBase+0x80:
			out = append(out, byte(r-rawBase+0x80))
		case c.m == mapPairs && r >= pairBase && r <= pairBase+0xffff:
			out = append(out, byte((r-pairBase)>>8), byte(r-pairBase))
		default:
			return nil, &Error{Code: "22P05", Message: fmt.Sprintf("character %q has no equivalent in encoding %q", r, c.client.String())}
		}
	}
	return out, nil
}

func (c *Codec) invalid(rest []byte) *Error {
	n := mblen(c.rules, rest)
	if n > len(rest) {
		n = len(rest)
	}
	return &Error{Code: "22021", Message: fmt.Sprintf("invalid byte sequence for encoding %q: %s", c.rules.String(), hexBytes(rest[:n]))}
}

func (c *Codec) untranslatable(ch []byte) *Error {
	return &Error{Code: "22P05", Message: fmt.Sprintf("character with byte sequence %s in encoding %q has no equivalent in encoding \"UTF8\"", hexBytes(ch), c.rules.String())}
}

// gb18030HasFFFD reports whether b holds GB18030's own encoding of U+FFFD
// (0x84 0x31 0xA4 0x37), which x/text decodes as the replacement character
// it is.
func gb18030HasFFFD(b []byte) bool {
	return strings.Contains(string(b), "\x84\x31\xa4\x37")
}

func hexBytes(b []byte) string {
	var sb strings.Builder
	for i, x := range b {
		if i > 0 {
			sb.WriteByte(' ')
		}
		fmt.Fprintf(&sb, "0x%02x", x)
	}
	return sb.String()
}

func ascii(b []byte) bool {
	for _, x := range b {
		if x >= 0x80 {
			return false
		}
	}
	return true
}

func asciiString(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

// asciiTrails are the encodings in which a multi-byte character may end
// in an ASCII byte (by PostgreSQL's rules, verify): in every other one
// each byte of such a character is above 0x7F (TestASCIITrails).
var asciiTrails = []ID{SJIS, ShiftJIS2004, BIG5, GBK, UHC, GB18030}

// SameASCII reports whether, in every encoding PostgreSQL accepts from a
// client, each ASCII byte of b that the encoding accepts is a character
// of its own: no multi-byte character takes an ASCII byte in. Text for
// which it holds has the same ASCII structure (its quotes, backslashes,
// semicolons, comment marks, keywords) whatever the client_encoding is,
// or is refused (an encoding in which b is invalid reads nothing of it).
// In SJIS, SHIFT_JIS_2004, BIG5, GBK, UHC and GB18030 the second byte of
// a character may be ASCII: 0x81 0x5C is one SJIS character, and a
// backslash read byte by byte.
func SameASCII(b []byte) bool {
	if ascii(b) {
		return true
	}
	for _, id := range asciiTrails {
		for i := 0; i < len(b); {
			if b[i] < 0x80 {
				i++
				continue
			}
			n := verify(id, b[i:])
			if n < 0 || n == 2 && b[i+1] < 0x40 && (id == BIG5 || id == GBK || id == UHC) {
				// Invalid in id: the server refuses the text. (BIG5,
				// GBK and UHC pairs are checked only by their
				// conversion, which knows no second byte below 0x40.)
				break
			}
			for _, x := range b[i+1 : i+n] {
				if x < 0x80 {
					return false
				}
			}
			i += n
		}
	}
	return true
}
