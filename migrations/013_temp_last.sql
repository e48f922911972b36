-- Migration 013: pg_temp last in every pgfence function's search_path.
--
-- Every session has a temporary schema of its own, and PostgreSQL searches
-- it FIRST for relation and type names (never for functions or operators)
-- unless the search_path names pg_temp explicitly. pgfence's functions
-- pinned search_path = pg_catalog, fence (or pg_catalog), which left the
-- caller's temporary schema in front: a SECURITY DEFINER function (the
-- protocol, the backstop, the DDL guard) that declared a variable of type
-- text or regclass, or read pg_inherits, resolved the name to the caller's
-- temporary domain or view, whose CHECK or body then ran as the function's
-- owner, a superuser. Any login (PUBLIC has TEMP) made itself superuser
-- with a domain pg_temp.text and one call of fence.acquire or one DDL
-- command (issue 30, attack round 0). PostgreSQL's documentation of
-- SECURITY DEFINER says to list pg_temp last; this does it for every
-- function of schema fence that pins a search_path, whatever migration
-- made it, and the migrations' test refuses a function that does not
-- (TestFunctionsPinTempLast), so a later CREATE OR REPLACE cannot bring
-- the old path back unseen.
do $$
declare
  r record;
  v_path text;
begin
  for r in
    select p.oid::pg_catalog.regprocedure as fn, c.cfg
      from pg_catalog.pg_proc p, pg_catalog.unnest(p.proconfig) as c(cfg)
     where p.pronamespace operator(pg_catalog.=) 'fence'::pg_catalog.regnamespace
       and c.cfg operator(pg_catalog.~~) 'search_path=%'
  loop
    v_path := pg_catalog.substr(r.cfg, pg_catalog.length('search_path=') + 1);
    if v_path operator(pg_catalog.!~) '(^|,\s*)"?pg_temp"?\s*$' then
      execute pg_catalog.format('alter function %s set search_path = %s, pg_temp', r.fn, v_path);
    end if;
  end loop;
end
$$;
