package proxy

import (
	"testing"
)

func TestSimpleQueryMultiStatement(t *testing.T) {
	p := startProxy(t, Config{})
	db := cluster.NewDatabase(t)
	c := connect(t, p.dsn(db))
	res, err := c.Exec(ctxT(t), "CREATE TABLE t(a int); INSERT INTO t VALUES (1),(2),(3); SELECT a FROM t ORDER BY a; SELECT 'x'").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 4 {
		t.Fatalf("got %d results, want 4", len(res))
	}
	if got := res[1].CommandTag.String(); got != "INSERT 0 3" {
		t.Errorf("got tag %q, want INSERT 0 3", got)
	}
	if got := len(res[2].Rows); got != 3 || string(res[2].Rows[2][0]) != "3" {
		t.Errorf("got rows %q, want 1,2,3", res[2].Rows)
	}
	if string(res[3].Rows[0][0]) != "x" {
		t.Errorf("got %q, want x", res[3].Rows[0][0])
	}
	if c.TxStatus() != 'I' {
		t.Errorf("tx status %c, want I", c.TxStatus())
	}
}
