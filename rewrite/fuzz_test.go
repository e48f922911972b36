package rewrite

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	pg_query "github.com/pganalyze/pg_query_go/v6"
)

// FuzzClassify: Classify never panics, and a statement that writes a
// relation — found independently by a crude walk of pg_query's JSON parse
// tree for InsertStmt, UpdateStmt, DeleteStmt, MergeStmt, TruncateStmt and
// CopyStmt with is_from, outside subtrees that are not executed (plain
// EXPLAIN, function bodies, rule actions) — is classified as writing every
// one of those relations. And every relation the statement names anywhere
// (every RangeVar of the tree, at any depth: subqueries, CTE bodies, COPY
// queries, cursors, EXPLAIN, PREPARE) is reported as read or written,
// except an unqualified name that some CTE of the statement bears (which
// of those are CTE references is the classifier's scoping, pinned by the
// golden files): the read router's protected-read check depends on it.
func FuzzClassify(f *testing.F) {
	files, _ := filepath.Glob(filepath.Join(goldenDir, "*.sql"))
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		for _, line := range strings.Split(string(data), "\n") {
			if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "--") {
				f.Add(line)
			}
		}
	}
	for _, sql := range []string{
		"BEGIN; SET LOCAL fence.step = 'a'",
		"begin;set fence.token='1'; -- c\n",
		"START TRANSACTION;\tSET LOCAL fence.payload_digest TO 'x''y'  ;",
		"SET fence.job_key = 'k'",
	} {
		f.Add(sql)
	}
	f.Fuzz(func(t *testing.T, sql string) {
		// A crash in the C parser or deparser kills the fuzz worker
		// before Go can save the input; FUZZ_TRACE=file records each
		// input first so the culprit can be found.
		if p := os.Getenv("FUZZ_TRACE"); p != "" {
			os.WriteFile(p, []byte(sql), 0o644)
		}
		res, err := Classify(sql)
		if !utf8.ValidString(sql) {
			if !errors.Is(err, ErrInvalidUTF8) {
				t.Fatalf("invalid UTF-8: got error %v, want ErrInvalidUTF8", err)
			}
			return
		}
		js, jerr := pg_query.ParseToJSON(sql)
		if (err == nil) != (jerr == nil) {
			t.Fatalf("Classify error %v but ParseToJSON error %v", err, jerr)
		}
		if err != nil {
			return
		}
		var tree struct {
			Stmts []struct {
				Stmt any `json:"stmt"`
			} `json:"stmts"`
		}
		if err := json.Unmarshal([]byte(js), &tree); err != nil {
			t.Fatalf("unmarshal parse tree: %v", err)
		}
		checkShapeShared(t, sql, res)
		checkFenceSetShape(t, sql, res)
		checkReadings(t, sql, res)
		if len(tree.Stmts) != len(res.Stmts) {
			t.Fatalf("got %d statements, parse tree has %d", len(res.Stmts), len(tree.Stmts))
		}
		for i, raw := range tree.Stmts {
			want := map[RelName]bool{}
			crudeWrites(raw.Stmt, want)
			got := map[RelName]bool{}
			for s := res.Stmts[i]; s != nil; s = s.Inner {
				for _, r := range s.WriteTargets {
					got[r] = true
				}
			}
			for r := range want {
				if !got[r] {
					t.Errorf("statement %d (%q): writes %v per the parse tree, but classified %s with writes %v",
						i+1, res.Stmts[i].SQL, r, res.Stmts[i].Kind, res.Stmts[i].WriteTargets)
				}
			}
			named := map[RelName]bool{}
			ctes := map[string]bool{}
			crudeNames(raw.Stmt, named, ctes)
			for s := res.Stmts[i]; s != nil; s = s.Inner {
				for _, r := range s.ReadRelations {
					got[r] = true
				}
			}
			for r := range named {
				if !got[r] && (r.Schema != "" || !ctes[r.Name]) {
					t.Errorf("statement %d (%q): names relation %v per the parse tree, but classified %s with reads %v and writes %v",
						i+1, res.Stmts[i].SQL, r, res.Stmts[i].Kind, res.Stmts[i].ReadRelations, res.Stmts[i].WriteTargets)
				}
			}
			_ = res.Stmts[i].Canonical() // must not crash (deparses writes only)
		}
	})
}

// crudeWrites collects written relations from a JSON parse tree.
func crudeWrites(n any, out map[RelName]bool) {
	switch v := n.(type) {
	case []any:
		for _, e := range v {
			crudeWrites(e, out)
		}
	case map[string]any:
		for key, child := range v {
			m, _ := child.(map[string]any)
			switch key {
			case "CreateFunctionStmt", "RuleStmt":
				continue
			case "ExplainStmt":
				if !crudeAnalyze(m) {
					continue
				}
			case "InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt":
				addCrude(m["relation"], out)
			case "CopyStmt":
				if m["is_from"] == true {
					addCrude(m["relation"], out)
				}
			case "TruncateStmt":
				if rels, ok := m["relations"].([]any); ok {
					for _, r := range rels {
						if rm, ok := r.(map[string]any); ok {
							addCrude(rm["RangeVar"], out)
						}
					}
				}
			}
			crudeWrites(child, out)
		}
	}
}

// crudeNames collects every RangeVar of a JSON parse tree (a message with
// relname and relpersistence, whether wrapped in a RangeVar node or not)
// and every CTE name.
func crudeNames(n any, rels map[RelName]bool, ctes map[string]bool) {
	switch v := n.(type) {
	case []any:
		for _, e := range v {
			crudeNames(e, rels, ctes)
		}
	case map[string]any:
		if _, ok := v["relpersistence"]; ok {
			if name, ok := v["relname"].(string); ok {
				schema, _ := v["schemaname"].(string)
				rels[RelName{Schema: schema, Name: name}] = true
			}
		}
		if name, ok := v["ctename"].(string); ok {
			ctes[name] = true
		}
		for _, child := range v {
			crudeNames(child, rels, ctes)
		}
	}
}

func addCrude(rv any, out map[RelName]bool) {
	m, ok := rv.(map[string]any)
	if !ok {
		return
	}
	schema, _ := m["schemaname"].(string)
	name, _ := m["relname"].(string)
	out[RelName{Schema: schema, Name: name}] = true
}

// crudeAnalyze reports whether EXPLAIN options include ANALYZE that is not
// explicitly false.
func crudeAnalyze(explain map[string]any) bool {
	opts, _ := explain["options"].([]any)
	analyze := false
	for _, o := range opts {
		om, _ := o.(map[string]any)
		d, _ := om["DefElem"].(map[string]any)
		if d == nil || d["defname"] != "analyze" {
			continue
		}
		analyze = true
		arg, _ := d["arg"].(map[string]any)
		if arg == nil {
			continue
		}
		b, _ := json.Marshal(arg)
		s := strings.ToLower(string(b))
		switch {
		case strings.Contains(s, `"boolval":{}`), strings.Contains(s, `{"integer":{}}`), strings.Contains(s, `{"boolean":{}}`),
			strings.Contains(s, `"sval":"false"`), strings.Contains(s, `"sval":"off"`),
			strings.Contains(s, `"sval":"0"`), strings.Contains(s, `"sval":"f"`),
			strings.Contains(s, `"sval":"n"`), strings.Contains(s, `"sval":"no"`):
			analyze = false
		}
	}
	return analyze
}

// checkReadings: the names a classification trusts as built-ins are the
// classifier's trusted names, and a text without a backslash classifies
// alike whatever standard_conforming_strings says (SameClass).
func checkReadings(t *testing.T, sql string, res *Result) {
	t.Helper()
	names, prefixes := TrustedByName()
	for _, st := range res.Stmts {
		for _, n := range st.Builtins {
			if !slices.Contains(names, n) && !slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(n, p) }) {
				t.Fatalf("%q trusts %q as a built-in, which TrustedByName does not list", sql, n)
			}
		}
	}
	if strings.Contains(sql, `\`) {
		return
	}
	off, err := ClassifyWith(sql, Options{NonStandardStrings: true})
	if err != nil || !SameClass(res, off) {
		t.Fatalf("%q classifies otherwise with standard_conforming_strings off (%v)", sql, err)
	}
}
