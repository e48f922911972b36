package fence

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"
)

// DigestVersion names the payload digest encoding computed by Digest. It is
// stored with every receipt; a future version never reinterprets a v1
// receipt.
const DigestVersion = "v1"

// digestPrefix starts the final hash so that a v1 digest can never collide
// with the hash of anything else.
const digestPrefix = "pgfence-digest-v1\x00"

// Item tags keep statement and COPY items in separate domains.
const (
	tagStatement = 'S'
	tagCopy      = 'C'
)

// Param is one bound parameter of a statement, as it appears in a Bind
// message.
type Param struct {
	Format  int16  // 0 text, 1 binary
	TypeOID uint32 // 0 when the server infers the type
	Value   []byte // ignored when Null
	Null    bool
}

// Digest accumulates the v1 payload digest of a transaction's writes (DESIGN
// §5). The zero value is ready to use; a Digest is not safe for concurrent
// use.
//
// Every item (a statement with its parameters, or the whole data stream of
// one COPY FROM) is reduced to its own SHA-256, so a Digest holds 32 bytes
// per item, and a savepoint rollback is a truncation (Mark, Rollback). The
// final digest is
//
//	SHA-256("pgfence-digest-v1\x00" ‖ item₁ ‖ item₂ ‖ …)
//
// where a statement item is
//
//	SHA-256('S' ‖ u32 len(sql) ‖ sql ‖ u32 nparams ‖ { i16 format ‖ u32 type OID ‖ i32 len or -1 for NULL ‖ bytes }…)
//
// and a COPY item is SHA-256('C' ‖ the concatenated CopyData payloads).
// Integers are big-endian. The encoding is pinned by
// testdata/digest_v1.golden.
type Digest struct {
	h       hash.Hash // statement item hash, reused
	copy    hash.Hash // running COPY item hash
	inCopy  bool
	items   []byte // completed item hashes, 32 bytes each
	scratch []byte
}

func (d *Digest) init() {
	if d.h == nil {
		d.h = sha256.New()
		d.copy = sha256.New()
	}
}

// Statement adds one write statement: its canonical SQL text and its bound
// parameters in order. A COPY that is still open is ended first.
func (d *Digest) Statement(canonicalSQL string, params []Param) {
	d.init()
	if d.inCopy {
		d.EndCopy()
	}
	b := append(d.scratch[:0], tagStatement)
	b = binary.BigEndian.AppendUint32(b, uint32(len(canonicalSQL)))
	b = append(b, canonicalSQL...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(params)))
	d.h.Reset()
	for i := range params {
		p := &params[i]
		b = binary.BigEndian.AppendUint16(b, uint16(p.Format))
		b = binary.BigEndian.AppendUint32(b, p.TypeOID)
		if p.Null {
			b = binary.BigEndian.AppendUint32(b, 0xFFFFFFFF) // -1
			continue
		}
		b = binary.BigEndian.AppendUint32(b, uint32(len(p.Value)))
		if len(p.Value) > 256 {
			// Large values go straight into the hash, not through scratch.
			d.h.Write(b)
			d.h.Write(p.Value)
			b = b[:0]
			continue
		}
		b = append(b, p.Value...)
	}
	d.h.Write(b)
	d.scratch = b[:0]
	d.items = d.h.Sum(d.items)
}

// CopyData adds a chunk of a COPY FROM data stream. Chunk boundaries do not
// matter: the stream is hashed as one item until EndCopy.
func (d *Digest) CopyData(p []byte) {
	d.init()
	if !d.inCopy {
		d.copy.Reset()
		d.copy.Write([]byte{tagCopy})
		d.inCopy = true
	}
	d.copy.Write(p)
}

// EndCopy closes the current COPY item. An empty COPY (no CopyData) still
// counts as one item.
func (d *Digest) EndCopy() {
	d.init()
	if !d.inCopy {
		d.copy.Reset()
		d.copy.Write([]byte{tagCopy})
	}
	d.inCopy = false
	d.items = d.copy.Sum(d.items)
}

// Mark returns a position to roll back to (taken at a SAVEPOINT).
func (d *Digest) Mark() int { return len(d.items) / sha256.Size }

// Rollback drops every item added after mark (ROLLBACK TO SAVEPOINT),
// including an open COPY.
func (d *Digest) Rollback(mark int) {
	d.inCopy = false
	if mark < 0 {
		mark = 0
	}
	if n := mark * sha256.Size; n < len(d.items) {
		d.items = d.items[:n]
	}
}

// Empty reports whether no item has been added (or all were rolled back).
func (d *Digest) Empty() bool { return len(d.items) == 0 && !d.inCopy }

// Len is the number of items.
func (d *Digest) Len() int {
	n := d.Mark()
	if d.inCopy {
		n++
	}
	return n
}

// Sum returns the 32-byte digest of the items so far; an open COPY counts as
// if it were ended. It does not change the Digest.
func (d *Digest) Sum() []byte {
	d.init()
	f := sha256.New()
	f.Write([]byte(digestPrefix))
	f.Write(d.items)
	if d.inCopy {
		var c [sha256.Size]byte
		f.Write(d.copy.Sum(c[:0]))
	}
	return f.Sum(make([]byte, 0, sha256.Size))
}

// Reset empties the Digest for the next transaction, keeping its buffers.
func (d *Digest) Reset() {
	d.items = d.items[:0]
	d.inCopy = false
}
