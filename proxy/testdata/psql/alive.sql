-- Every script's last check: the session still answers (\ir alive.sql).
SELECT 1 AS alive;
\echo state :SQLSTATE
