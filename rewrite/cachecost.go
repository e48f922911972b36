package rewrite

import (
	"unsafe"

	"google.golang.org/protobuf/proto"
)

// What the Classifier's cached entries cost, in bytes of heap: the caches
// are bounded by it (internal/lru), not by a number of entries, since a
// client makes its statements as large as it likes.
//
// The parse tree is most of it: pg_query's tree decoded into Go takes
// 14 to 20 times the bytes of its protobuf encoding (measured: IN lists,
// INSERT ... VALUES, OR chains, a one-table upsert), 35 to 185 times the
// text for dense statements (`SELECT 1,1,1,...`). A cached statement keeps
// its tree only when it writes, for Canonical (the payload digest);
// Canonical never reads the tree of any other statement, so the cache
// drops those (keep). The cost of a tree kept is its encoded size
// (proto.Size, a walk of the tree: 8 µs for a one-table select, 14 µs
// for an upsert, against 55 to 85 µs for classifying them; only a miss
// pays it) times treeHeapPerWireByte.

// treeHeapPerWireByte is what a byte of a parse tree's protobuf encoding
// takes on the Go heap, decoded (measured 14 to 19.4; rounded up).
const treeHeapPerWireByte = 20

var (
	resultSize = int64(unsafe.Sizeof(Result{}))
	stmtSize   = int64(unsafe.Sizeof(Stmt{})) + 8 // and its pointer in Result.Stmts
	relSize    = int64(unsafe.Sizeof(RelName{}))
	gucSize    = int64(unsafe.Sizeof(GUC{}))
)

// entryCost is what caching res (or err) costs, with text the bytes of
// the key and of the classified text when they are not the same string:
// Stmt.SQL is a slice of the classified text, which the entry keeps whole.
// It drops the parse trees the cache need not keep (keep).
func entryCost(text int, res *Result, err error) int64 {
	n := int64(text)
	if err != nil {
		n += int64(len(err.Error())) + 64
	}
	if res != nil {
		n += keep(res)
	}
	return n
}

// keep drops the parse trees of res's statements that do not write (only
// a writing statement's Canonical deparses its tree) and returns what the
// rest of res costs besides its text.
func keep(res *Result) int64 {
	n := resultSize
	for _, st := range res.Stmts {
		n += keepStmt(st)
	}
	return n
}

func keepStmt(st *Stmt) int64 {
	n := stmtSize + int64(len(st.Name)+len(st.Isolation)+len(st.Executes))
	for _, rels := range [][]RelName{st.WriteTargets, st.ReadRelations} {
		for _, r := range rels {
			n += relSize + int64(len(r.Schema)+len(r.Name))
		}
	}
	for _, g := range st.GUCs {
		n += gucSize + int64(len(g.Name)+len(g.Value))
	}
	if st.Inner != nil {
		n += keepStmt(st.Inner)
	}
	if !st.Writes() {
		st.node = nil // Canonical is the trimmed text
		return n
	}
	if st.node != nil {
		n += treeHeapPerWireByte * int64(proto.Size(st.node))
	}
	return n + int64(len(st.SQL)) // Canonical, once computed
}
