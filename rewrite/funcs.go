package rewrite

import (
	"slices"
	"strings"
)

// primaryOnly are the built-in functions (unqualified or in pg_catalog)
// that must run on the primary: they write (sequences, notifications,
// large objects), take locks that others must see, assign a transaction
// id, or change session state the proxy tracks; so do those whose names
// begin with one of primaryOnlyPrefixes (advisory locks).
var (
	primaryOnly = map[string]bool{}
	// primaryOnlyPrefixes: advisory locks.
	primaryOnlyPrefixes = []string{"pg_advisory_", "pg_try_advisory_"}
)

func init() {
	for _, f := range strings.Fields(`
		nextval setval currval lastval
		txid_current txid_current_if_assigned pg_current_xact_id pg_current_xact_id_if_assigned
		pg_notify set_config
		pg_backend_pid
		pg_current_wal_lsn pg_current_wal_insert_lsn pg_current_wal_flush_lsn pg_switch_wal pg_create_restore_point
		lo_create lo_creat lo_import lo_unlink lo_put lo_from_bytea lo_open lo_truncate lo_truncate64 lowrite
	`) {
		primaryOnly[f] = true // pg_backend_pid: the session's backend is the primary's (BackendKeyData says so)
	}
}

// primaryOnlyFuncs reports whether the built-in function name must run on
// the primary (primaryOnly).
func primaryOnlyFuncs(name string) bool {
	if primaryOnly[name] {
		return true
	}
	for _, p := range primaryOnlyPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// TrustedByName returns the names the classifier takes for PostgreSQL's
// built-ins when a statement calls them unqualified (Stmt.Builtins
// records which it relied on), sorted, and the prefixes of further such
// names. The proxy asks a database which of them it also has outside
// pg_catalog: PostgreSQL may call those instead.
func TrustedByName() (names, prefixes []string) {
	for n := range readOnlyFuncs {
		names = append(names, n)
	}
	for n := range primaryOnly {
		if !readOnlyFuncs[n] {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return names, slices.Clone(primaryOnlyPrefixes)
}

// readOnlyFuncs are common built-in functions that cannot write anything, so
// calling them does not make a statement Opaque. Anything not listed here
// (user functions, unlisted built-ins) makes it Opaque: a conservative hint,
// since the backstop trigger fences what functions write.
var readOnlyFuncs = map[string]bool{}

func init() {
	for _, f := range strings.Fields(`
		count sum avg min max array_agg string_agg json_agg jsonb_agg json_object_agg jsonb_object_agg
		bool_and bool_or every bit_and bit_or stddev variance percentile_cont percentile_disc mode
		row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value
		now current_timestamp clock_timestamp statement_timestamp transaction_timestamp timeofday
		date_trunc date_part extract age make_date make_time make_timestamp make_timestamptz make_interval
		to_char to_date to_timestamp to_number
		lower upper length char_length octet_length bit_length substr substring position strpos
		trim btrim ltrim rtrim lpad rpad replace split_part concat concat_ws format left right reverse repeat
		initcap md5 sha224 sha256 sha384 sha512 encode decode quote_ident quote_literal quote_nullable
		regexp_replace regexp_match regexp_matches regexp_split_to_array regexp_split_to_table starts_with
		abs ceil ceiling floor round trunc sign mod power sqrt exp ln log greatest least random gen_random_uuid
		coalesce nullif
		array_length array_position array_positions array_remove array_append array_prepend array_cat
		array_to_string string_to_array unnest cardinality array_lower array_upper generate_series generate_subscripts
		json_build_object jsonb_build_object json_build_array jsonb_build_array to_json to_jsonb row_to_json
		jsonb_set jsonb_insert jsonb_strip_nulls jsonb_pretty json_extract_path jsonb_extract_path
		json_extract_path_text jsonb_extract_path_text jsonb_array_elements json_array_elements
		jsonb_array_elements_text json_array_elements_text jsonb_each json_each jsonb_each_text json_each_text
		jsonb_object_keys json_object_keys jsonb_typeof json_typeof jsonb_array_length json_array_length
		current_setting current_database current_schema current_schemas current_user session_user
		version pg_backend_pid pg_is_in_recovery pg_last_wal_replay_lsn pg_last_wal_receive_lsn
		pg_wal_lsn_diff pg_postmaster_start_time inet_server_addr inet_server_port
		pg_typeof pg_column_size pg_relation_size pg_total_relation_size pg_size_pretty
		has_table_privilege has_schema_privilege has_function_privilege pg_has_role
		to_regclass to_regtype to_regproc pg_get_viewdef pg_get_indexdef pg_get_constraintdef pg_get_functiondef
		obj_description col_description format_type
	`) {
		readOnlyFuncs[f] = true
	}
}

// sessionLocalFuncs and sessionLocalViews are the built-in functions and
// system views that report the state of the session's own backend or of
// the server it runs on: its settings (current_setting,
// pg_settings: transaction_read_only is on for any replica session), its
// prepared statements, cursors and notifications, its temporary schema,
// its connection, the server's activity, locks, statistics and files.
// Another connection, a replica's above all, answers them differently,
// so a read of one is not routed to a replica (Stmt.SessionLocal; round
// 3, attacker H's M1: pg_prepared_statements read on the replica showed
// none of the session's statements). A name missing here is read on a
// replica as any catalog is: the catalogs are the primary's, replicated.
//
// Only readOnlyFuncs can reach a replica at all (any other function makes
// a statement Opaque, which runs on the primary), so that list is the
// whole of what must be reviewed: each of its names that reports the
// node or the session rather than the data is here too, including the
// session's identity and search path (current_user and the other SQL
// value functions of the role, current_schema, current_schemas) and the
// server's WAL position and version (round 5, attacker K's M2). The one
// exception is pg_is_in_recovery, which the test suite uses to see which
// node answered (docs/reads.md, Limits).
//
// PostgreSQL itself says which built-ins depend on the backend that runs
// them: it marks them PARALLEL RESTRICTED or UNSAFE (pg_proc.proparallel
// <> 's'), as a parallel worker would answer otherwise. Every name of
// readOnlyFuncs with such an overload is here (the proxy's
// TestReadBuiltinsParallelSafe checks it against the server's catalog):
// random (its generator, which setseed seeds: round 6, attacker M's L1),
// age (age(xid) reads the backend's transaction), pg_get_viewdef (its
// text form resolves the name in the session's search_path).
//
// The size of a relation's files (pg_relation_size,
// pg_total_relation_size) is the node's storage too, and it grows with
// the rows: a lagging replica's is the previous generation's (round 8,
// attacker P's M1; the relation is named in a string, which no read set
// can see). pg_column_size measures a value the statement read itself.
var (
	sessionLocalFuncs = map[string]bool{}
	sessionLocalViews = map[string]bool{}
)

func init() {
	for _, f := range strings.Fields(`
		current_setting pg_show_all_settings pg_settings_get_flags
		pg_prepared_statement pg_cursor pg_listening_channels pg_notification_queue_usage
		pg_my_temp_schema pg_is_other_temp_schema pg_trigger_depth
		inet_client_addr inet_client_port inet_server_addr inet_server_port
		pg_postmaster_start_time pg_conf_load_time pg_current_logfile pg_backend_memory_contexts
		pg_get_backend_memory_contexts pg_stat_get_activity pg_blocking_pids pg_safe_snapshot_blocking_pids
		pg_lock_status pg_current_snapshot txid_current_snapshot pg_prepared_xact
		pg_stat_get_backend_pid pg_stat_get_backend_idset pg_stat_get_xact_numscans
		pg_is_in_backup pg_last_xact_replay_timestamp pg_get_wal_replay_pause_state pg_is_wal_replay_paused
		pg_last_wal_replay_lsn pg_last_wal_receive_lsn version
		current_schema current_schemas current_user current_role session_user user
		random age pg_get_viewdef
		pg_relation_size pg_total_relation_size
	`) {
		sessionLocalFuncs[f] = true
	}
	for _, v := range strings.Fields(`
		pg_prepared_statements pg_cursors pg_settings pg_file_settings pg_hba_file_rules pg_ident_file_mappings
		pg_stat_activity pg_locks pg_prepared_xacts pg_backend_memory_contexts pg_shmem_allocations
		pg_stat_replication pg_stat_wal_receiver pg_stat_subscription pg_replication_slots pg_stat_ssl pg_stat_gssapi
		pg_stat_database pg_stat_database_conflicts pg_stat_bgwriter pg_stat_wal pg_stat_archiver pg_stat_slru
		pg_stat_all_tables pg_stat_user_tables pg_stat_sys_tables pg_stat_xact_all_tables pg_stat_xact_user_tables
		pg_stat_xact_sys_tables pg_statio_all_tables pg_statio_user_tables pg_statio_sys_tables
		pg_stat_all_indexes pg_stat_user_indexes pg_stat_sys_indexes pg_statio_all_indexes pg_statio_user_indexes
		pg_statio_sys_indexes pg_statio_all_sequences pg_statio_user_sequences pg_statio_sys_sequences
		pg_stat_user_functions pg_stat_xact_user_functions pg_stat_progress_vacuum pg_stat_progress_analyze
		pg_stat_progress_create_index pg_stat_progress_cluster pg_stat_progress_basebackup pg_stat_progress_copy
		pg_stat_recovery_prefetch pg_stat_replication_slots pg_stat_io pg_stat_statements pg_stat_statements_info
	`) {
		sessionLocalViews[v] = true
	}
}

// ReadOnlyBuiltin reports whether name is a built-in the classifier lets
// reach a replica (readOnlyFuncs), and if so whether it is also
// session-local (sessionLocalFuncs: run on the primary). The proxy's
// tests check the list against the catalog (pg_proc.proparallel).
func ReadOnlyBuiltin(name string) (readOnly, sessionLocal bool) {
	return readOnlyFuncs[name], sessionLocalFuncs[name] || primaryOnlyFuncs(name)
}

// SessionLocalNames lists, sorted, the built-in functions and system
// views a read of which is not routed to a replica (sessionLocalFuncs,
// sessionLocalViews): the proxy's read set marks the views and policies
// that call or read one as running code (proxy/fence_catalog.go).
func SessionLocalNames() (funcs, views []string) {
	for f := range sessionLocalFuncs {
		funcs = append(funcs, f)
	}
	for v := range sessionLocalViews {
		views = append(views, v)
	}
	slices.Sort(funcs)
	slices.Sort(views)
	return funcs, views
}

// SessionSafeNames lists, sorted, what the proxy's read set needs to tell
// the built-ins that cannot change the session's state (set_config,
// nextval, an advisory lock, setseed can) from the others, in a view's or
// a policy's definition, where the classifier never sees the call:
// readOnly, the volatile built-ins known to be read-only (readOnlyFuncs
// less primaryOnly), and primaryOnly and prefixes, the built-ins that
// need the primary whatever PostgreSQL says of their volatility
// (primaryOnlyFuncs: txid_current assigns an xid, pg_backend_pid answers
// the node). proxy/fence_catalog.go, readSetCTE's safe_builtin.
func SessionSafeNames() (readOnly, primaryOnlyNames, prefixes []string) {
	for n := range readOnlyFuncs {
		if !primaryOnlyFuncs(n) {
			readOnly = append(readOnly, n)
		}
	}
	for n := range primaryOnly {
		primaryOnlyNames = append(primaryOnlyNames, n)
	}
	slices.Sort(readOnly)
	slices.Sort(primaryOnlyNames)
	return readOnly, primaryOnlyNames, slices.Clone(primaryOnlyPrefixes)
}
