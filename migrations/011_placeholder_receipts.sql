-- Placeholder for migration 011, which the helper "receipts" writes on its
-- own branch (issue 30). tern refuses a gap in the numbering, so this
-- branch carries an empty 011 to test 012; the coordinator drops this file
-- when it merges the real 011. It changes nothing.
select 1;
