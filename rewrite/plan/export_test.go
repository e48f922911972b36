package plan

// NumFacts is the number of facts in a Cache's key (1 to NumFacts-1).
const NumFacts = int(numFacts)

// factNames names the facts of the Cache's key, by their constants: a fact
// added without a name has none (TestPlanCacheKeyFacts fails).
var factNames = [numFacts]string{
	factNone: "none", factGated: "gated", factTentative: "tentative", factExplicit: "explicit",
	factTxDigest: "transaction digest", factPayloadDigest: "payload digest",
	factJobKeySet: "job key set", factEpochOK: "epoch valid", factTokenOK: "token valid",
	factKind: "kind", factChain: "chain", factOpaque: "opaque", factName: "name", factTables: "tables' answers",
	factGUCOp: "guc op", factGUCName: "guc name", factGUCValue: "guc value", factGUCValueParam: "guc value param",
	factGUCUnknown: "guc unknown",
}

// FactName names a fact of the Cache's key, for the test that leaves each
// out ("" for a fact without a name).
func FactName(f int) string { return factNames[f] }

// Omit makes c leave fact f out of its keys (0: none).
func (c *Cache) Omit(f int) { c.omit = fact(f) }
