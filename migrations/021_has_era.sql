-- Issue 31: a replica that serves reads is on the primary's history.
-- docs/reads.md ("Replicas across a failover") describes the defence.
--
-- After a failover, WAL positions of the old and the new timeline are not
-- comparable: a replica that replayed the old primary's WAL past the point
-- where the promoted standby's history forked off is diverged (it holds
-- transactions the new primary never had, and cannot follow it without
-- pg_rewind), yet its replay position can be numerically at or past every
-- position the new primary reports. The proxy therefore routes a read to a
-- replica only once the replica has shown that it has the primary's
-- current era row (fence.eras, migration 019), which the new primary made
-- after its promotion: a replica that follows the new primary replays it,
-- a diverged one never has it.
--
-- fence.has_era(era, timeline, began_at) answers that on any server, a
-- read-only standby included: one index probe, no token, nothing about a
-- job. fence.eras is not readable by public, hence SECURITY DEFINER; the
-- era's number, timeline and start time identify it (two promotions of
-- different standbys to the same timeline make rows that differ in
-- began_at). Any role may ask; the answer tells only whether the server's
-- history includes that era.

create function fence.has_era(p_era integer, p_timeline integer, p_began_at timestamptz) returns boolean
language sql
stable
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
  select exists (select from fence.eras x
                  where x.era operator(pg_catalog.=) p_era
                    and x.timeline operator(pg_catalog.=) p_timeline
                    and x.began_at operator(pg_catalog.=) p_began_at)
$$;
revoke all on function fence.has_era(integer, integer, timestamptz) from public;
grant execute on function fence.has_era(integer, integer, timestamptz) to public;
