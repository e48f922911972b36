-- Issue 30 (attack round 14, AA Break 2): values that read through the
-- catalog. A value of an OID-alias type (regclass, regproc, regprocedure,
-- regoper, regoperator, regtype, regconfig, regdictionary, regnamespace,
-- regrole, regcollation) is stored as an OID and printed as the current
-- name of the object it points to; an aclitem prints the current names of
-- roles. So what a row holding one reads is not the row's own: a table
-- owner added an empty regclass, regproc or regtype column to a protected
-- table (allowed: existing rows read NULL), a fenced write stored values
-- in it, and the owner then renamed the table, function or type they
-- pointed to (or dropped it: the row read a bare number). No DDL touched
-- the protected table, so the DDL guard, which refuses the same change
-- when it comes from a column's type (oid to regclass) or a renamed type
-- a column uses, saw nothing.
--
-- Such columns now cannot come to a protected table except by an
-- administrator (a superuser or a pgfence_bypass member, by session_user,
-- fence.is_admin): a value reads through the catalog when its type is one
-- whose output function is pg_catalog's reg…out or aclitemout, directly,
-- as an array's element, a domain's base, a composite's attribute or a
-- range's (or multirange's) subtype, at any depth
-- (fence.catalog_value_type, walking as fence.read_facts does). Refused to
-- anyone else:
--   - fence.protect of a tree with a member that has such a column (55000);
--   - a new column of such a type on a protected member, by ALTER TABLE …
--     ADD COLUMN (also on a partitioned root or an inheritance parent), or
--     by ALTER TYPE … ADD ATTRIBUTE … CASCADE on a typed table's type
--     (FN010, fence.read_change);
--   - a table joining a protected tree (CREATE TABLE … INHERITS, ALTER
--     TABLE … INHERIT) with such a column of its own (FN010,
--     fence.join_problem). A partition has only the tree's columns.
-- Already refused before (read shapes, 012): changing a column's type into
-- one (ALTER COLUMN … TYPE), and a composite in use gaining an attribute
-- (ALTER TYPE … ADD ATTRIBUTE). A domain's base cannot change.
--
-- Tables protected before this migration that already have such a column
-- keep it (nothing here rewrites a table): the migration names them in a
-- WARNING (and pgfence migrate names them on every run, from
-- fence.catalog_value_tables), and docs/security.md's Known limits says
-- what to do (an administrator turns the column into text, or oid).
-- The owner's other DDL on them passes as before: only columns arriving
-- after they were recorded are judged.

-- catalog_value_type: the first type reachable from p_type whose values
-- read through the catalog (format_type), or NULL. "Reachable" follows
-- domains to their base types, arrays to their elements, composites to
-- their attributes' types and ranges (and multiranges) to their subtypes,
-- as fence.read_facts does. The types are found by their output function
-- (pg_catalog's reg…out: every OID-alias type, including any a later
-- PostgreSQL adds; and aclitemout), not by a list of names.
create function fence.catalog_value_type(p_type oid) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  with recursive used(oid) as (
    select p_type
    union
    select n.oid
      from used u
     cross join lateral (select t.oid, t.typtype, t.typbasetype, t.typelem, t.typlen, t.typrelid
                           from pg_catalog.pg_type t where t.oid operator(pg_catalog.=) u.oid offset 0) t
     cross join lateral (
       select t.typbasetype where t.typtype operator(pg_catalog.=) 'd'
       union all
       select t.typelem where t.typelem operator(pg_catalog.<>) 0 and t.typlen operator(pg_catalog.=) -1
       union all
       select a.atttypid from pg_catalog.pg_attribute a
        where t.typtype operator(pg_catalog.=) 'c' and a.attrelid operator(pg_catalog.=) t.typrelid
          and a.attnum operator(pg_catalog.>) 0 and not a.attisdropped
       union all
       select r.rngsubtype from pg_catalog.pg_range r
        where t.typtype operator(pg_catalog.=) 'r' and r.rngtypid operator(pg_catalog.=) t.oid
       union all
       -- a multirange (PostgreSQL 14 on) depends internally on its range
       select d.refobjid from pg_catalog.pg_depend d
        where t.typtype operator(pg_catalog.=) 'm'
          and d.classid operator(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass and d.objid operator(pg_catalog.=) t.oid
          and d.refclassid operator(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass
          and d.deptype operator(pg_catalog.=) 'i') n(oid))
  select pg_catalog.format_type(t.oid, null)
    from used u
    join pg_catalog.pg_type t on t.oid operator(pg_catalog.=) u.oid
    join pg_catalog.pg_proc p on p.oid operator(pg_catalog.=) t.typoutput
   where p.pronamespace operator(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
     and (p.proname operator(pg_catalog.~) '^reg[a-z]+out$' or p.proname operator(pg_catalog.=) 'aclitemout')
   order by 1
   limit 1
$$;

-- catalog_value_column: a phrase naming a column of rel whose values read
-- through the catalog (only the columns of its own, not inherited, when
-- p_own is true), or NULL.
create function fence.catalog_value_column(rel regclass, p_own boolean) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select pg_catalog.format('column %I of type %s', a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod))
      || case when v.ty operator(pg_catalog.=) pg_catalog.format_type(a.atttypid, null) then ''
              else pg_catalog.format(' (which holds %s)', v.ty) end
    from pg_catalog.pg_attribute a
   cross join lateral (select fence.catalog_value_type(a.atttypid) as ty) v
   where a.attrelid operator(pg_catalog.=) rel and a.attnum operator(pg_catalog.>) 0 and not a.attisdropped
     and (not p_own or a.attinhcount operator(pg_catalog.=) 0)
     and v.ty is not null
   order by a.attnum
   limit 1
$$;

create or replace function fence.read_change(rel regclass, p_old jsonb, p_new jsonb) returns text
language plpgsql stable
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  f jsonb;
  v_ty text;
begin
  for f in select e from jsonb_array_elements(p_old) e except select e from jsonb_array_elements(p_new) e loop
    case f->>'k'
    when 'col' then
      if exists (select 1 from jsonb_array_elements(p_new) g
                  where g->>'k' = 'col' and g->'i' = f->'i' and g->>'n' = f->>'n' and g->>'c' = f->>'c'
                    and fence.same_reading_type(f->>'t', (f->>'m')::int, g->>'t', (g->>'m')::int)) then
        continue;
      end if;
      if exists (select 1 from jsonb_array_elements(p_new) g where g->>'k' = 'col' and g->'i' = f->'i' and g->>'n' = f->>'n') then
        return format('change the type or collation of its column %I (%s) so that it reads otherwise', f->>'n', f->>'t');
      end if;
      return format('drop or rename its column %I', f->>'n');
    when 'rls' then
      return 'change its row-level security';
    when 'pol' then
      return format('drop or change its row-level security policy %I', f->>'n');
    when 'enum' then
      return format('rename value %L of enum type %s, which it uses', f->>'l', f->>'t');
    when 'attr' then
      return format('change attribute %I of composite type %s, which it uses (or rename that type)', f->>'n', f->>'t');
    else
      return format('change what it reads (%s)', f::text);
    end case;
  end loop;
  for f in select e from jsonb_array_elements(p_new) e except select e from jsonb_array_elements(p_old) e loop
    case f->>'k'
    when 'col' then
      if exists (select 1 from jsonb_array_elements(p_old) g where g->>'k' = 'col' and g->'i' = f->'i') then
        continue; -- a changed column, judged above
      end if;
      if exists (select 1 from pg_catalog.pg_attribute a
                  where a.attrelid = rel and a.attname = f->>'n' and not a.attisdropped
                    and (a.atthasmissing or a.attgenerated <> '')) then
        return format('add column %I with a value for its existing rows (a default)', f->>'n');
      end if;
      -- (028) Values that read through the catalog are not the row's own.
      select fence.catalog_value_type(a.atttypid) into v_ty
        from pg_catalog.pg_attribute a
       where a.attrelid = rel and a.attname = f->>'n' and a.attnum > 0 and not a.attisdropped;
      if v_ty is not null then
        return format('add column %I of type %s%s, whose values read the current names of catalog objects, not the row''s own (store the name as text, or the number as oid)',
                      f->>'n', f->>'t', case when v_ty = f->>'t' then '' else format(' (which holds %s)', v_ty) end);
      end if;
    when 'pol' then
      return format('add row-level security policy %I', f->>'n');
    when 'enum' then
      null; -- a new label, or a type a new column brought
    when 'attr' then
      if exists (select 1 from jsonb_array_elements(p_old) g where g->>'k' = 'attr' and g->>'t' = f->>'t') then
        return format('add an attribute to composite type %s, which it uses', f->>'t');
      end if;
    else
      return format('change what it reads (%s)', f::text);
    end case;
  end loop;
  return null;
end
$$;

create or replace function fence.join_problem(p_rel regclass, p_root regclass) returns text
language plpgsql stable
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v text;
begin
  -- Triggers: any of its own (not a clone of a trigger of the tree's
  -- members, which only an administrator can have made); pgfence's own are
  -- installed after this check.
  select format('its trigger %I', t.tgname) into v
    from pg_catalog.pg_trigger t
   where t.tgrelid = p_rel and not t.tgisinternal
     and not exists (select 1 from pg_catalog.pg_trigger pt join fence.protected_tables q on q.relid = pt.tgrelid
                      where pt.oid = t.tgparentid and q.root = p_root)
   limit 1;
  if v is not null then
    return v;
  end if;
  select format('its rule %I', w.rulename) into v from pg_catalog.pg_rewrite w where w.ev_class = p_rel limit 1;
  if v is not null then
    return v;
  end if;
  if exists (select 1 from pg_catalog.pg_class c where c.oid = p_rel and (c.relrowsecurity or c.relforcerowsecurity))
     or exists (select 1 from pg_catalog.pg_policy p where p.polrelid = p_rel) then
    return 'row-level security';
  end if;
  -- Code its own defaults, generation expressions, constraints, indexes
  -- and statistics objects run (pg_depend records what an expression
  -- calls, by OID, so no search_path or name can hide it).
  with objs(classid, objid, what) as (
    select 'pg_catalog.pg_attrdef'::pg_catalog.regclass, d.oid, format('the default or generation expression of its column %I', a.attname)
      from pg_catalog.pg_attrdef d join pg_catalog.pg_attribute a on a.attrelid = d.adrelid and a.attnum = d.adnum
     where d.adrelid = p_rel
       and not exists (select 1 from pg_catalog.pg_inherits i
                         join fence.protected_tables q on q.relid = i.inhparent and q.root = p_root
                         join pg_catalog.pg_attribute pa on pa.attrelid = i.inhparent and pa.attname = a.attname
                         join pg_catalog.pg_attrdef pd on pd.adrelid = pa.attrelid and pd.adnum = pa.attnum
                        where i.inhrelid = p_rel
                          and pg_catalog.pg_get_expr(pd.adbin, pd.adrelid) operator(pg_catalog.=) pg_catalog.pg_get_expr(d.adbin, d.adrelid))
    union all
    select 'pg_catalog.pg_constraint'::pg_catalog.regclass, c.oid, format('its constraint %I', c.conname)
      from pg_catalog.pg_constraint c where c.conrelid = p_rel and c.coninhcount = 0
    union all
    select 'pg_catalog.pg_class'::pg_catalog.regclass, i.indexrelid, format('its index %s', i.indexrelid::pg_catalog.regclass)
      from pg_catalog.pg_index i
     where i.indrelid = p_rel
       and not exists (select 1 from pg_catalog.pg_inherits h
                         join pg_catalog.pg_index pi on pi.indexrelid = h.inhparent
                         join fence.protected_tables q on q.relid = pi.indrelid and q.root = p_root
                        where h.inhrelid = i.indexrelid)
    union all
    select 'pg_catalog.pg_statistic_ext'::pg_catalog.regclass, s.oid, format('its statistics object %I', s.stxname)
      from pg_catalog.pg_statistic_ext s where s.stxrelid = p_rel)
  select format('%s, which depends on %s', o.what, pg_catalog.pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid)) into v
    from objs o join pg_catalog.pg_depend d on d.classid = o.classid and d.objid = o.objid
   where not fence.superuser_made(d.refclassid, d.refobjid)
   limit 1;
  if v is not null then
    return v;
  end if;
  -- Its own columns (the tree's have the tree's types and collations).
  select format('its column %I of type %s', a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)) into v
    from pg_catalog.pg_attribute a
   where a.attrelid = p_rel and a.attnum > 0 and not a.attisdropped and a.attinhcount = 0
     and (not fence.superuser_made('pg_catalog.pg_type'::pg_catalog.regclass, a.atttypid)
          or a.attcollation <> 0 and not fence.superuser_made('pg_catalog.pg_collation'::pg_catalog.regclass, a.attcollation))
   limit 1;
  if v is not null then
    return v;
  end if;
  -- (028) Its own columns whose values read through the catalog (the
  -- tree's columns were judged when they came).
  v := fence.catalog_value_column(p_rel, true);
  if v is not null then
    return format('its %s, whose values read the current names of catalog objects, not the row''s own (store the name as text, or the number as oid)', v);
  end if;
  return null;
end
$$;

create or replace function fence.protect(tbl regclass, job_key_column text default null) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_kind "char";
  v_schema name;
  v_name name;
  v_type regtype;
  v_existing fence.protected_tables;
  v_protected boolean;
  v_roots text;
  v_member regclass;
  v_what text;
begin
  if tbl is null then
    raise exception 'fence.protect needs a table' using errcode = '22023';
  end if;
  select c.relkind, n.nspname, c.relname into v_kind, v_schema, v_name
    from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
   where c.oid = tbl;
  if v_kind is distinct from 'r' and v_kind is distinct from 'p' then
    raise exception 'cannot protect %: only tables can be protected', tbl
      using errcode = '42809', hint = 'protect the table beneath the view; writes through views are fenced by its trigger';
  end if;
  if v_schema = 'fence' then
    raise exception 'cannot protect %: pgfence''s own tables are guarded by privileges', tbl using errcode = '42809';
  end if;
  if job_key_column is not null then
    select a.atttypid::regtype into v_type
      from pg_catalog.pg_attribute a
     where a.attrelid = tbl and a.attname = job_key_column and a.attnum > 0 and not a.attisdropped;
    if not found then
      raise exception 'cannot protect %: column "%" does not exist', tbl, job_key_column using errcode = '42703';
    end if;
    if v_type not in ('text'::regtype, 'character varying'::regtype, 'character'::regtype) then
      raise exception 'cannot protect %: job key column "%" has type %, want text', tbl, job_key_column, v_type
        using errcode = '42804';
    end if;
  end if;

  select * into v_existing from fence.protected_tables p where p.relid = tbl for update;
  v_protected := found;
  if v_protected and v_existing.job_key_column is distinct from job_key_column then
    raise exception 'cannot protect %: it is already protected with job key column %', tbl,
        coalesce(quote_ident(v_existing.job_key_column), 'none')
      using errcode = '55000', hint = 'unprotect it first (fence.unprotect), then protect it with the new column';
  end if;
  if exists (select 1 from pg_catalog.pg_inherits i where i.inhrelid = tbl) then
    if v_protected then
      raise notice '% is already protected, as a member of the protected tree of %; nothing to do', tbl, v_existing.root;
      return;
    end if;
    select string_agg(r::text, ', ') into v_roots from fence.tree_roots(tbl) r;
    raise exception 'cannot protect %: it is a partition or inheritance child of %, and protection covers a whole tree', tbl, v_roots
      using errcode = '42809',
            detail = 'writes naming the root would reach its rows without firing its statement triggers',
            hint = format('protect the root instead: fence.protect(%L) protects every table below it, now and later', v_roots);
  end if;
  -- (028) A column whose values read through the catalog: only an
  -- administrator may protect it (and so take what it reads as it is).
  if not fence.is_admin() then
    select m.relid, fence.catalog_value_column(m.relid, false) into v_member, v_what
      from fence.tree_members(tbl) m
     where not exists (select 1 from fence.protected_tables q where q.relid = m.relid)
       and fence.catalog_value_column(m.relid, false) is not null
     order by m.relid::text
     limit 1;
    if found then
      raise exception 'cannot protect %: % has %, whose values read the current names of catalog objects, not the row''s own', tbl, v_member, v_what
        using errcode = '55000',
              detail = 'a value of an OID-alias type (regclass, regproc, regtype, …) or aclitem is stored as an OID and read as the current name of what it points to, so renaming or dropping that object would change what protected rows read without a fenced write',
              hint = 'store the name as text (or the number as oid) instead, e.g. ALTER TABLE … ALTER COLUMN … TYPE text, then protect the table; or ask a member of pgfence_bypass (a DBA) to protect it as it is';
    end if;
  end if;
  if fence.sync_tree(tbl, job_key_column, true) then
    perform pg_notify('pgfence_protected', format('%I.%I', v_schema, v_name));
  else
    raise notice '% is already protected; nothing to do', tbl;
  end if;
end
$$;

-- Tables protected before this migration with such a column keep it: they
-- are named here (and by fence.catalog_value_tables, which pgfence migrate
-- reads), for an administrator to turn the column into text or oid.
create function fence.catalog_value_tables() returns table (relid regclass, what text)
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select q.relid, w.what
    from fence.protected_tables q
   cross join lateral (select fence.catalog_value_column(q.relid, false) as what) w
   where exists (select 1 from pg_catalog.pg_class c where c.oid operator(pg_catalog.=) q.relid)
     and w.what is not null
   order by q.relid::pg_catalog.text
$$;
revoke all on function fence.catalog_value_tables() from public;
grant execute on function fence.catalog_value_tables() to pgfence_bypass;

do $$
declare
  v text;
begin
  select pg_catalog.string_agg(pg_catalog.format('%s (%s)', t.relid, t.what), '; ') into v from fence.catalog_value_tables() t;
  if v is not null then
    raise warning 'protected tables whose rows hold values that read through the catalog: %', v
      using detail = 'what such a row reads changes when the object its value points to is renamed or dropped, without a fenced write; the table owner can no longer add such columns, but these stay',
            hint = 'have an administrator turn each column into text (ALTER TABLE … ALTER COLUMN … TYPE text keeps the names the rows read now) or oid; see docs/security.md, Known limits';
  end if;
end
$$;
