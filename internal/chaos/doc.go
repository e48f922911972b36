// Package chaos is the chaos run of pgfence (make chaos, and a short run
// in make test): a real primary and streaming replica, two `pgfence serve`
// processes in front of them, workers under `pgfence run` with a short TTL
// competing for a few job keys, readers that read through the proxies'
// replica route while carrying a generation, a consumer applying outbox
// events with fence.accept_event, and a seeded nemesis (zombie workers,
// killed proxies, terminated backends, lost commit responses, paused WAL
// replay, a restarted primary; on request, one failover in asynchronous or
// synchronous mode, see failover.go and docs/failover.md). At the end it
// stops everything, waits for the replica to replay, and runs the checker
// (package audit) with the workers' and readers' own records.
//
// A worker records every attempt (job, epoch, token, step, payload digest
// and the outcome it saw) in a JSON-lines file; Run collects them. The
// harness also reports anomalies the database cannot show: a careful retry
// answered as a conflict, a conflicting payload answered as a commit.
//
// It is a test harness, not part of pgfence: nothing here is reachable
// from the pgfence binary. The build tag pgfence_chaos_broken (broken.go)
// makes its workers skip the fence, to prove the checker can fail; only a
// test builds it.
package chaos
