package rewrite

// libpg_query can parse as if standard_conforming_strings were off, but
// pg_query_go does not expose its parser options; this calls the C
// function directly (it is linked in with pg_query_go's parser package,
// whose init has set the parser up).

/*
#include <stdlib.h>
#include <stddef.h>

typedef struct {
	char* message;
	char* funcname;
	char* filename;
	int lineno;
	int cursorpos;
	char* context;
} PgQueryError;

typedef struct {
	size_t len;
	char* data;
} PgQueryProtobuf;

typedef struct {
	PgQueryProtobuf parse_tree;
	char* stderr_buffer;
	PgQueryError* error;
} PgQueryProtobufParseResult;

PgQueryProtobufParseResult pg_query_parse_protobuf_opts(const char* input, int parser_options);
void pg_query_free_protobuf_parse_result(PgQueryProtobufParseResult result);

// PG_QUERY_DISABLE_STANDARD_CONFORMING_STRINGS in pg_query.h.
#define PGFENCE_SCS_OFF 32
*/
import "C"

import (
	"unsafe"

	pg_query "github.com/pganalyze/pg_query_go/v6"
	"github.com/pganalyze/pg_query_go/v6/parser"
	"google.golang.org/protobuf/proto"
)

// parseSCSOff parses sql as PostgreSQL does with
// standard_conforming_strings off: a backslash in an ordinary string
// literal is an escape, as in E'...'.
func parseSCSOff(sql string) (*pg_query.ParseResult, error) {
	in := C.CString(sql)
	defer C.free(unsafe.Pointer(in))
	res := C.pg_query_parse_protobuf_opts(in, C.PGFENCE_SCS_OFF)
	defer C.pg_query_free_protobuf_parse_result(res)
	if e := res.error; e != nil {
		pe := &parser.Error{Message: C.GoString(e.message), Lineno: int(e.lineno), Cursorpos: int(e.cursorpos)}
		if e.funcname != nil {
			pe.Funcname = C.GoString(e.funcname)
		}
		if e.filename != nil {
			pe.Filename = C.GoString(e.filename)
		}
		if e.context != nil {
			pe.Context = C.GoString(e.context)
		}
		return nil, pe
	}
	tree := &pg_query.ParseResult{}
	if err := proto.Unmarshal(C.GoBytes(unsafe.Pointer(res.parse_tree.data), C.int(res.parse_tree.len)), tree); err != nil {
		return nil, err
	}
	return tree, nil
}
