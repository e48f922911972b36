package rewrite

import (
	lru "github.com/hashicorp/golang-lru/v2"
)

// Classifier classifies statements through an LRU cache keyed by the exact
// statement text, shared by all sessions. Parse errors are cached too. It is
// safe for concurrent use.
type Classifier struct {
	cache *lru.Cache[string, entry]
}

type entry struct {
	res *Result
	err error
}

// NewClassifier returns a Classifier caching up to size query strings
// (at least 1).
func NewClassifier(size int) *Classifier {
	if size < 1 {
		size = 1
	}
	c, err := lru.New[string, entry](size)
	if err != nil {
		panic("rewrite: " + err.Error()) // unreachable: size > 0
	}
	return &Classifier{cache: c}
}

// Classify returns the cached classification of sql, classifying and
// caching it on a miss. The returned Result is shared: do not modify it.
func (c *Classifier) Classify(sql string) (*Result, error) {
	if e, ok := c.cache.Get(sql); ok {
		return e.res, e.err
	}
	res, err := Classify(sql)
	c.cache.Add(sql, entry{res: res, err: err})
	return res, err
}

// Len returns the number of cached query strings.
func (c *Classifier) Len() int { return c.cache.Len() }
