-- Attack round 25 (attacker BA).
--
-- PostgreSQL takes what a table's CHECK constraints and partial indexes
-- declare as true of its rows, and acts on it without looking at the
-- rows: the planner's constraint exclusion drops a member of a tree from
-- a query, a partial index whose predicate a query implies answers it
-- alone (and its qual is dropped), ALTER TABLE ... SET NOT NULL and
-- CREATE TABLE ... PARTITION OF (over a default partition) skip their
-- scans. It folds the immutable expressions of those declarations when it
-- plans or runs the DDL, and 032 (AX-H1) judged only the functions and
-- operators a CHECK calls. But a superuser's immutable function may read
-- objects the table's owner owns and changes at will:
--
-- BA-H1, BA-H3, BA-H4. A CHECK calling only pg_catalog's
-- to_tsvector(regconfig, ...) or ts_lexize(regdictionary, ...) over the
-- owner's text search configuration or dictionary, then ALTER TEXT
-- SEARCH ..., made a member's rows vanish from every query of its tree
-- (the job's own fenced UPDATE and DELETE found nothing and were
-- receipted), left a row in the wrong partition for good, and made a
-- column NOT NULL over a NULL row (the table's next restore lost every
-- row).
-- BA-H2. A partial index did the same on any protected table, with those
-- functions or the owner's own (replaced later): queries returned rows
-- contradicting their WHERE and hid the one that matched. The guard did
-- not look at indexes at all, nor did it see CREATE INDEX as DDL on the
-- table.
--
-- Attack round 26 (attacker BD) found the first form of this too narrow:
-- a configuration named by a computed OID (`(16763)::regconfig` stores no
-- dependency), pg_catalog's immutable pg_partition_root(regclass) of the
-- owner's index (an index counted as fixed), CREATE INDEX CONCURRENTLY,
-- whose index stays (invalid) after the guard refuses it and which REINDEX,
-- firing no event trigger on PostgreSQL 15, makes valid, a CHECK added in
-- a transaction open across fence.protect, and a joining member's
-- partition key.
--
-- Attack round 28 (attacker BJ): pg_catalog's output functions are
-- marked immutable but print as the session's settings say, and REINDEX
-- rebuilds an index under the owner's session: refused too.
--
-- Attack round 27 (attacker BG) found more that PostgreSQL trusts and
-- the rows do not say: a whole-row test a later ADD COLUMN makes false
-- for every row; tableoid, current_user or statement_timestamp() in a
-- CHECK, which a restore then fails; an SQL function without a pinned
-- search_path (citext's) whose operators resolve under the search_path
-- of whoever builds or REINDEXes the index, the owner's; and a function
-- replaced in a transaction open across the DBA's CREATE INDEX.
--
-- Now a CHECK constraint or an index of a protected table may depend on
-- nothing its owner can change: every object it depends on (pg_depend:
-- functions, operators, types, text search configurations and
-- dictionaries, other relations, ...) other than the table itself must be
-- a superuser's (fence.declared_fixed; a text search configuration's
-- dictionaries too; an enum type or a collation, which cannot be changed
-- to say otherwise, may be anyone's), or the guard refuses the DDL that
-- leaves it, for a non-administrator, and fence.protect a table that has
-- one. Nor may it, or a member's partition key, hold a value of an
-- OID-alias type (regclass, regconfig, regdictionary, ...), however it
-- is computed: what a function reads through one is the catalog's current
-- state (fence.declaration_reads_catalog). CREATE INDEX, ALTER INDEX and
-- REINDEX count as DDL on the index's table. A non-administrator's change
-- to a function, an operator or a text search configuration or dictionary
-- is refused while a protected table has such a declaration (an
-- administrator's, or one CREATE INDEX CONCURRENTLY left behind): what it
-- declares cannot be made to change. fence.protect refuses a table that
-- has one, whoever calls it, once it holds the table's lock.

-- declared_fixed: whether what a CHECK constraint or an index depends on,
-- the object p_oid of catalog p_class, is beyond a non-superuser's reach:
-- made by a superuser (and, for a text search configuration, every
-- dictionary it maps to), an enum type or a collation. Unknown catalogs
-- are not.
create function fence.declared_fixed(p_class oid, p_oid oid) returns boolean
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select coalesce(case p_class
    when 'pg_catalog.pg_proc'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    when 'pg_catalog.pg_operator'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    when 'pg_catalog.pg_opclass'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    when 'pg_catalog.pg_opfamily'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    -- An enum's labels keep their order (ADD VALUE only adds), and its
    -- text output is not folded (enum_out is stable).
    when 'pg_catalog.pg_type'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    -- A collation cannot be changed, only renamed.
    when 'pg_catalog.pg_collation'::pg_catalog.regclass then true
    when 'pg_catalog.pg_ts_config'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_ts_config x join pg_catalog.pg_roles r on r.oid = x.cfgowner where x.oid = p_oid)
      and not exists (select 1 from pg_catalog.pg_ts_config_map m
                        join pg_catalog.pg_ts_dict d on d.oid = m.mapdict
                        join pg_catalog.pg_roles r on r.oid = d.dictowner
                       where m.mapcfg = p_oid and not r.rolsuper)
    when 'pg_catalog.pg_ts_dict'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_ts_dict x join pg_catalog.pg_roles r on r.oid = x.dictowner where x.oid = p_oid)
    when 'pg_catalog.pg_class'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_class x join pg_catalog.pg_roles r on r.oid = x.relowner where x.oid = p_oid)
    else false end, false)
$$;
revoke all on function fence.declared_fixed(oid, oid) from public;

-- declaration_reads_catalog: whether an expression (a stored node tree)
-- holds a value of an OID-alias type, or an array of one: every type of
-- every node is named in the tree (":consttype", ":resulttype",
-- ":funcresulttype", ":vartype", ...), however the value is computed.
create function fence.declaration_reads_catalog(p_tree pg_node_tree) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
  select p_tree is not null and exists (
    select 1
      from pg_catalog.regexp_matches(p_tree::text, ':[a-z_]*type[a-z_]* ([0-9]+)', 'gi') m
      join pg_catalog.pg_type t on t.oid = m[1]::oid
     where t.oid in ('pg_catalog.regclass'::pg_catalog.regtype, 'pg_catalog.regconfig'::pg_catalog.regtype,
                     'pg_catalog.regdictionary'::pg_catalog.regtype, 'pg_catalog.regproc'::pg_catalog.regtype,
                     'pg_catalog.regprocedure'::pg_catalog.regtype, 'pg_catalog.regoper'::pg_catalog.regtype,
                     'pg_catalog.regoperator'::pg_catalog.regtype, 'pg_catalog.regtype'::pg_catalog.regtype,
                     'pg_catalog.regnamespace'::pg_catalog.regtype, 'pg_catalog.regrole'::pg_catalog.regtype,
                     'pg_catalog.regcollation'::pg_catalog.regtype)
        or t.typelem in ('pg_catalog.regclass'::pg_catalog.regtype, 'pg_catalog.regconfig'::pg_catalog.regtype,
                     'pg_catalog.regdictionary'::pg_catalog.regtype, 'pg_catalog.regproc'::pg_catalog.regtype,
                     'pg_catalog.regprocedure'::pg_catalog.regtype, 'pg_catalog.regoper'::pg_catalog.regtype,
                     'pg_catalog.regoperator'::pg_catalog.regtype, 'pg_catalog.regtype'::pg_catalog.regtype,
                     'pg_catalog.regnamespace'::pg_catalog.regtype, 'pg_catalog.regrole'::pg_catalog.regtype,
                     'pg_catalog.regcollation'::pg_catalog.regtype))
$$;
revoke all on function fence.declaration_reads_catalog(pg_node_tree) from public;

-- declaration_functions: the functions an expression (a stored node
-- tree) calls, its operators' included.
create function fence.declaration_functions(p_tree pg_node_tree) returns setof oid
language sql stable
set search_path = pg_catalog, pg_temp
as $$
  select m[2]::oid from pg_catalog.regexp_matches(p_tree::text, ':(funcid|opfuncid) ([0-9]+)', 'g') m
  union
  select o.oprcode::oid from pg_catalog.regexp_matches(p_tree::text, ':opno ([0-9]+)', 'g') m
    join pg_catalog.pg_operator o on o.oid = m[1]::oid
$$;
revoke all on function fence.declaration_functions(pg_node_tree) from public;

-- declaration_names_problem: a function an expression calls (an
-- operator's too) that resolves names at run time under the caller's
-- search_path (an SQL or PL function without a search_path of its own),
-- as a phrase, or null. Whoever builds or REINDEXes an index runs it
-- under their own search_path, where their operator or function of the
-- same name is found first (round 27, BG-H4: citext's SQL functions and
-- the owner's operator ||): not even an administrator's declaration may
-- call one.
create function fence.declaration_names_problem(p_tree pg_node_tree) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
  select pg_catalog.format('function %s, which resolves names under the search_path of whoever runs it', x.oid::pg_catalog.regprocedure)
    from fence.declaration_functions(p_tree) f join pg_catalog.pg_proc x on x.oid = f
   where x.prolang not in (select l.oid from pg_catalog.pg_language l where l.lanname in ('internal', 'c'))
     and x.prosqlbody is null -- a BEGIN ATOMIC body is parsed when made
     and not exists (select 1 from pg_catalog.unnest(x.proconfig) c where pg_catalog.left(c, 12) = 'search_path=')
   order by x.oid
   limit 1
$$;
-- declaration_code_problem: what in an expression (a stored node tree)
-- makes its value something other than a function of the row's own
-- values, or null: a whole-row or system column (a whole-row test
-- changes with ADD COLUMN, tableoid with a restore), a function or
-- operator that is not immutable (current_user, statement_timestamp(),
-- a text cast through a type's I/O), or one that resolves names at run
-- time under the caller's search_path (an SQL or PL function without its
-- own: citext's SQL functions, run by whoever builds or REINDEXes the
-- index).
create function fence.declaration_code_problem(p_tree pg_node_tree) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
  with tree(t) as (select p_tree::text where p_tree is not null),
  funcs(f) as (select fence.declaration_functions(p_tree))
  select coalesce(
    (select 'a whole-row or system column' from tree where tree.t ~ ':varattno (0|-[0-9]+)'),
    (select 'a value of the session (current_user, current_timestamp, ...)' from tree where tree.t ~ '[{](SQLVALUEFUNCTION|COERCEVIAIO|NEXTVALUEEXPR|CURRENTOFEXPR|PARAM|XMLEXPR) '),
    (select pg_catalog.format('function %s, which is not immutable', x.oid::pg_catalog.regprocedure)
       from funcs join pg_catalog.pg_proc x on x.oid = funcs.f
      where x.provolatile <> 'i' order by x.oid limit 1),
    -- A type's output function, though marked immutable, prints what
    -- the session's settings say (float8out: extra_float_digits;
    -- byteaout: bytea_output), and REINDEX runs it under the session of
    -- whoever rebuilds the index (round 28, BJ-H1).
    (select pg_catalog.format('function %s, a type''s output function, which prints as the session''s settings say', x.oid::pg_catalog.regprocedure)
       from funcs join pg_catalog.pg_proc x on x.oid = funcs.f
      where exists (select 1 from pg_catalog.pg_type ty where ty.typoutput = x.oid) order by x.oid limit 1),
    fence.declaration_names_problem(p_tree))
$$;

revoke all on function fence.declaration_code_problem(pg_node_tree), fence.declaration_names_problem(pg_node_tree) from public;

-- declaration_names_rel: declaration_names_problem for rel's CHECK
-- constraints, indexes and partition key, as the guard says it, or null.
create function fence.declaration_names_rel(p_rel regclass) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select pg_catalog.format('keep %s, which calls %s', d.what, fence.declaration_names_problem(d.tree))
    from (select pg_catalog.format('CHECK constraint %I', con.conname) as what, con.conbin as tree
            from pg_catalog.pg_constraint con where con.conrelid = p_rel and con.contype = 'c'
          union all
          select pg_catalog.format('index %s', i.indexrelid::pg_catalog.regclass), i.indexprs
            from pg_catalog.pg_index i where i.indrelid = p_rel
          union all
          select pg_catalog.format('index %s', i.indexrelid::pg_catalog.regclass), i.indpred
            from pg_catalog.pg_index i where i.indrelid = p_rel
          union all
          select 'its partition key', pt.partexprs
            from pg_catalog.pg_partitioned_table pt where pt.partrelid = p_rel) d
   where fence.declaration_names_problem(d.tree) is not null
   limit 1
$$;
revoke all on function fence.declaration_names_rel(regclass) from public;

-- declaration_problem: a CHECK constraint, an index (valid or not) or the
-- partition key of rel that depends on an object other than rel that is
-- not fixed (fence.declared_fixed; pg_depend's normal dependencies: a
-- partition's index depends on its parent's otherwise), or that holds a
-- value of an OID-alias type (fence.declaration_reads_catalog), as a
-- phrase for an error, or null.
create function fence.declaration_problem(p_rel regclass) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  with decl(what, ord, name, classid, objid, tree) as (
    select pg_catalog.format('CHECK constraint %I', con.conname), 1, con.conname::text,
           'pg_catalog.pg_constraint'::pg_catalog.regclass::oid, con.oid, con.conbin
      from pg_catalog.pg_constraint con
     where con.conrelid = p_rel and con.contype = 'c'
    union all
    select pg_catalog.format('index %s', i.indexrelid::pg_catalog.regclass), 2, i.indexrelid::pg_catalog.regclass::text,
           'pg_catalog.pg_class'::pg_catalog.regclass::oid, i.indexrelid, i.indexprs
      from pg_catalog.pg_index i
     where i.indrelid = p_rel
    union all
    select pg_catalog.format('index %s', i.indexrelid::pg_catalog.regclass), 2, i.indexrelid::pg_catalog.regclass::text,
           null, null, i.indpred
      from pg_catalog.pg_index i
     where i.indrelid = p_rel
    union all
    select 'its partition key', 3, '', null, null, pt.partexprs
      from pg_catalog.pg_partitioned_table pt
     where pt.partrelid = p_rel)
  select x.phrase from (
    select pg_catalog.format('%s, which depends on %s, not a superuser''s', d.what,
               pg_catalog.pg_describe_object(dep.refclassid, dep.refobjid, 0)) as phrase, d.ord, d.name
      from decl d
      join pg_catalog.pg_depend dep on dep.classid = d.classid and dep.objid = d.objid and dep.deptype = 'n'
     where not (dep.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass and dep.refobjid = p_rel)
       and not fence.declared_fixed(dep.refclassid, dep.refobjid)
    union all
    -- the partition key's functions and operators (the table's own
    -- dependencies: its columns' types and its schema are judged
    -- elsewhere)
    select pg_catalog.format('its partition key, which depends on %s, not a superuser''s',
               pg_catalog.pg_describe_object(dep.refclassid, dep.refobjid, 0)), 3, ''
      from pg_catalog.pg_partitioned_table pt
      join pg_catalog.pg_depend dep
        on dep.classid = 'pg_catalog.pg_class'::pg_catalog.regclass and dep.objid = pt.partrelid and dep.deptype = 'n'
     where pt.partrelid = p_rel
       and dep.refclassid in ('pg_catalog.pg_proc'::pg_catalog.regclass, 'pg_catalog.pg_operator'::pg_catalog.regclass,
                              'pg_catalog.pg_opclass'::pg_catalog.regclass, 'pg_catalog.pg_ts_config'::pg_catalog.regclass,
                              'pg_catalog.pg_ts_dict'::pg_catalog.regclass)
       and not fence.declared_fixed(dep.refclassid, dep.refobjid)
    union all
    select pg_catalog.format('%s, which holds a value of an OID-alias type (what a function reads through it is the catalog''s current state)', d.what), d.ord, d.name
      from decl d
     where fence.declaration_reads_catalog(d.tree)
    union all
    select pg_catalog.format('%s, which uses %s', d.what, fence.declaration_code_problem(d.tree)), d.ord, d.name
      from decl d
     where fence.declaration_code_problem(d.tree) is not null) x
   order by x.ord, x.name
   limit 1
$$;
revoke all on function fence.declaration_problem(regclass) from public;

-- exclusion_problem (032's, now for every declaration PostgreSQL
-- trusts), as the guard says it, or null.
create or replace function fence.exclusion_problem(p_rel regclass) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select 'keep ' operator(pg_catalog.||) v operator(pg_catalog.||)
         ': PostgreSQL trusts what it declares of the rows (constraint exclusion, a partial index''s predicate, the scans ALTER TABLE skips), and whoever owns that could change what it says'
    from fence.declaration_problem(p_rel) v
   where v is not null
$$;
revoke all on function fence.exclusion_problem(regclass) from public;

do $$
declare
  r record;
  v_def text;
begin
  for r in
    select f, v_old, v_new from (values
      ('fence.guard_ddl_end()'::regprocedure,
          $old$  if fence.guard_idle() then
    return;
  end if;$old$,
          $new$  if fence.guard_idle() then
    return;
  end if;
  -- (033) While a protected table has a CHECK constraint, an index or a
  -- partition key whose truth is not its rows' alone (an administrator's,
  -- or an index CREATE INDEX CONCURRENTLY left behind when the guard
  -- refused it, which REINDEX makes valid without an event trigger on
  -- PostgreSQL 15), a non-administrator's DDL is refused: DDL is how
  -- what it depends on changes (a function replaced, a text search
  -- object altered, a partition detached). Dropping it is let through,
  -- and so is what a session does in its temporary schema.
  select q.relid, fence.declaration_problem(q.relid) into v_rel, v_problem
    from fence.protected_tables q
   where exists (select 1 from pg_catalog.pg_event_trigger_ddl_commands() c
                  where c.schema_name is null or pg_catalog.left(c.schema_name, 7) <> 'pg_temp')
     and exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid)
     and fence.declaration_problem(q.relid) is not null
   order by q.relid::text
   limit 1;
  if found then
    v_allowed := fence.is_admin();
    if not v_allowed then
      raise exception '% while protected table % has %: that needs pgfence_bypass, and role "%" is not a member',
          tg_tag, v_rel, v_problem, session_user
        using errcode = 'FN010',
              detail = 'PostgreSQL acts on what a table''s CHECK constraints, partial indexes and partition keys declare without reading the rows; DDL could change what this one says',
              hint = 'drop it (an index CREATE INDEX CONCURRENTLY left behind, invalid, too), or ask a member of pgfence_bypass (a DBA) to make this change';
    end if;
  end if;
  v_problem := null;$new$),
      ('fence.guard_ddl_end()'::regprocedure,
          $old$          select q.root from fence.protected_tables q where q.relid = r.objid::regclass
          union$old$,
          $new$          select q.root from fence.protected_tables q where q.relid = r.objid::regclass
          union
          -- (033) CREATE INDEX, ALTER INDEX, REINDEX: the index's table
          select q.root from pg_catalog.pg_index x join fence.protected_tables q on q.relid = x.indrelid
           where x.indexrelid = r.objid
          union$new$),
      ('fence.join_problem(regclass, regclass)'::regprocedure,
          $old$begin
  -- Triggers:$old$,
          $new$begin
  -- (033) A CHECK constraint or an index whose truth its owner controls.
  v := fence.declaration_problem(p_rel);
  if v is not null then
    return v || ': PostgreSQL trusts what it declares of the rows';
  end if;
  -- Triggers:$new$),
      ('fence.guard_ddl_end()'::regprocedure,
          $old$        v_problem := fence.exclusion_problem(p.relid); -- (032) round 24, AX-H1
      end if;$old$,
          $new$        v_problem := fence.exclusion_problem(p.relid); -- (032) round 24, AX-H1
      end if;
      if v_problem is null and v_allowed then
        -- (033) Not even an administrator's: round 27, BG-H4.
        v_read := fence.declaration_names_rel(p.relid);
        if v_read is not null then
          raise exception '% on protected table % would %', v_tag, p.relid, v_read
            using errcode = 'FN010',
                  detail = 'whoever builds or reindexes the index (the table''s owner too, with REINDEX, which fires no event trigger) runs it under their own search_path, where an operator or function of theirs of the same name is found first',
                  hint = 'give the function a search_path of its own (ALTER FUNCTION … SET search_path = pg_catalog, …), or use one that has it';
        end if;
        v_read := null;
      end if;$new$),
      ('fence.guard_ddl_start()'::regprocedure,
          $old$  if fence.guard_idle() then
    return;
  end if;$old$,
          $new$  if fence.guard_idle() then
    return;
  end if;
  -- (033) CREATE INDEX CONCURRENTLY commits its index before the guard
  -- can refuse it at the command's end, and REINDEX (no event trigger on
  -- PostgreSQL 15) makes what is left valid: a non-administrator may not
  -- run it in a database with protected tables (round 26, BD-H3; round
  -- 27, BG-M1). The keyword cannot be hidden: it is one word of the
  -- statement's own text, which runs alone.
  if tg_tag = 'CREATE INDEX' and pg_catalog.strpos(pg_catalog.lower(pg_catalog.current_query()), 'concurrently') > 0
     and not fence.is_admin() then
    raise exception 'CREATE INDEX CONCURRENTLY in a database with protected tables needs pgfence_bypass, and role "%" is not a member', session_user
      using errcode = 'FN010',
            detail = 'a concurrent build commits its index before the DDL guard can judge it, and what a refusal leaves behind REINDEX would make valid',
            hint = 'build the index without CONCURRENTLY, or ask a member of pgfence_bypass (a DBA) to build it';
  end if;$new$),
      ('fence.protect(regclass, text)'::regprocedure,
          $old$  if fence.sync_tree(tbl, job_key_column, true) then
    perform pg_notify$old$,
          $new$  if fence.sync_tree(tbl, job_key_column, true) then
    -- (033) A CHECK constraint, an index or a partition key whose truth
    -- is not the rows' alone: refused, whoever protects. Judged here,
    -- once sync_tree holds the members' locks, so that one being added
    -- in a transaction still open is waited for and seen (round 26,
    -- BD-H4).
    select m.relid, fence.declaration_problem(m.relid) into v_member, v_what
      from fence.tree_members(tbl) m
     where fence.declaration_problem(m.relid) is not null
     order by m.relid::text
     limit 1;
    if found then
      raise exception 'cannot protect %: % has %', tbl, v_member, v_what
        using errcode = '55000',
              detail = 'PostgreSQL acts on what a table''s CHECK constraints, partial indexes and partition keys declare without reading the rows, so changing what they depend on would change which rows queries and fenced writes find without a fenced write',
              hint = 'drop it, or make it again with only columns, constants and a superuser''s functions, types and text search objects, then protect the table; an administrator may add it once the table is protected';
    end if;
    perform pg_notify$new$)
    ) v(f, v_old, v_new)
  loop
    v_def := pg_catalog.pg_get_functiondef(r.f);
    if pg_catalog.strpos(v_def, r.v_old) = 0 then
      raise exception 'trusted declarations migration: % has no %', r.f, r.v_old;
    end if;
    execute pg_catalog.replace(v_def, r.v_old, r.v_new);
  end loop;
end
$$;
