package plan

// NumFacts is the number of facts in a Cache's key (1 to NumFacts-1).
const NumFacts = int(numFacts)

// FactName names a fact of the Cache's key, for the test that leaves each
// out.
func FactName(f int) string {
	return [...]string{"none", "gated", "tentative", "explicit", "transaction digest", "digest mark", "payload digest",
		"job key set", "epoch valid", "token valid", "offset", "kind", "chain", "opaque", "name",
		"tables' answers", "guc op", "guc name", "guc value", "guc value param", "guc unknown"}[f]
}

// Omit makes c leave fact f out of its keys (0: none).
func (c *Cache) Omit(f int) { c.omit = fact(f) }
