-- Placeholder for migration 012, which the helper "ddlnotify" writes on its
-- own branch (issue 30). tern refuses a gap in the numbering, so this
-- branch carries an empty 012 to test 013; the coordinator drops this file
-- when it merges the real 012. It changes nothing.
select 1;
