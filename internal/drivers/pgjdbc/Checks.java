// pgjdbc's checks of the driver matrix (internal/drivers), run as a
// single-file program: java -cp /usr/share/java/postgresql.jar Checks.java
//
// The same checks run in each of pgjdbc's protocol modes (VARIANTS): the
// server-side prepare threshold (prepareThreshold: default 5, 0 never, 1 at
// once, -1 at once and binary from the first execution), the query mode
// (preferQueryMode: extended by default, simple, extendedForPrepared) and
// binary transfer off. pgjdbc sends BEGIN itself, in the same batch as the
// first statement of a transaction, and pipelines executeBatch.
//
// Prints one line per check: check TAB variant TAB name TAB ok|fail|n/a TAB detail.

import java.io.ByteArrayOutputStream;
import java.io.StringReader;
import java.math.BigDecimal;
import java.security.MessageDigest;
import java.sql.*;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.util.*;
import java.util.concurrent.*;
import java.util.concurrent.atomic.AtomicReference;

import org.postgresql.PGConnection;
import org.postgresql.PGNotification;
import org.postgresql.copy.CopyManager;
import org.postgresql.ds.PGConnectionPoolDataSource;
import javax.sql.PooledConnection;

public class Checks {
    static final String[][] VARIANTS = {
        {"pgjdbc"},
        {"pgjdbc prepareThreshold=0", "prepareThreshold", "0"},
        {"pgjdbc prepareThreshold=1", "prepareThreshold", "1"},
        {"pgjdbc prepareThreshold=-1", "prepareThreshold", "-1"},
        {"pgjdbc preferQueryMode=simple", "preferQueryMode", "simple"},
        {"pgjdbc preferQueryMode=extendedForPrepared", "preferQueryMode", "extendedForPrepared"},
        {"pgjdbc binaryTransfer=false", "binaryTransfer", "false"},
    };
    static final String UPSERT =
        "INSERT INTO results (job_key, payload, token) VALUES (?, ?, ?) "
        + "ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token "
        + "WHERE results.token < excluded.token";

    static final boolean PROXY = "proxy".equals(System.getenv("PGFENCE_TARGET"));
    static final String HOST = System.getenv("PGHOST");
    static final String PORT = System.getenv("PGPORT");
    static final String DB = System.getenv("PGDATABASE");
    static final String OBSERVER_PORT = System.getenv("PGFENCE_OBSERVER_PORT");

    static String variant;
    static Properties mode = new Properties();

    static class NotApplicable extends Exception {
        NotApplicable(String m) { super(m); }
    }

    interface Check { String run() throws Exception; }

    // --- helpers -------------------------------------------------------------

    static Connection connect(String... extra) throws SQLException {
        Properties p = new Properties();
        p.putAll(mode);
        p.setProperty("user", "postgres");
        p.setProperty("sslmode", "disable");
        for (int i = 0; i + 1 < extra.length; i += 2) p.setProperty(extra[i], extra[i + 1]);
        return DriverManager.getConnection("jdbc:postgresql://" + HOST + ":" + PORT + "/" + DB, p);
    }

    static Connection observer() throws SQLException {
        Properties p = new Properties();
        p.setProperty("user", "postgres");
        p.setProperty("sslmode", "disable");
        return DriverManager.getConnection("jdbc:postgresql://" + HOST + ":" + OBSERVER_PORT + "/" + DB, p);
    }

    static void expect(boolean cond, String msg) {
        if (!cond) throw new AssertionError(msg);
    }

    static void expectEq(Object got, Object want, String what) {
        if (!Objects.equals(got, want)) throw new AssertionError(what + ": got " + got + ", want " + want);
    }

    interface SqlRun { void run() throws Exception; }

    static String sqlstateOf(SqlRun r) throws Exception {
        try {
            r.run();
        } catch (SQLException e) {
            return e.getSQLState();
        }
        return null;
    }

    static Object one(Connection c, String sql, Object... args) throws SQLException {
        try (PreparedStatement ps = c.prepareStatement(sql)) {
            for (int i = 0; i < args.length; i++) ps.setObject(i + 1, args[i]);
            try (ResultSet rs = ps.executeQuery()) {
                return rs.next() ? rs.getObject(1) : null;
            }
        }
    }

    static void waitUntil(String what, Callable<Boolean> cond) throws Exception {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (!cond.call()) {
            if (System.nanoTime() > deadline) throw new AssertionError("timed out waiting for " + what);
            Thread.sleep(10);
        }
    }

    static String slug() {
        return variant.replace(' ', '_').replace('=', '_').replace('-', 'm');
    }

    static boolean simpleMode() {
        return "simple".equals(mode.getProperty("preferQueryMode"));
    }

    static int threshold() {
        return Integer.parseInt(mode.getProperty("prepareThreshold", "5"));
    }

    // --- checks --------------------------------------------------------------

    static String connectCheck() throws Exception {
        try (Connection c = connect()) {
            expect(c.getMetaData().getDatabaseMajorVersion() >= 15, "server version");
            expectEq(one(c, "SELECT 1"), 1, "SELECT 1");
        }
        return "";
    }

    static String simpleQuery() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            expect(s.execute("SELECT 1; SELECT 'two'"), "no result");
            try (ResultSet rs = s.getResultSet()) { rs.next(); expectEq(rs.getInt(1), 1, "first"); }
            expect(s.getMoreResults(), "no second result");
            try (ResultSet rs = s.getResultSet()) { rs.next(); expectEq(rs.getString(1), "two", "second"); }
        }
        return "";
    }

    static String extendedQuery() throws Exception {
        try (Connection c = connect(); PreparedStatement ps = c.prepareStatement("SELECT ?::int + ?, ?::text, ?::bool")) {
            ps.setInt(1, 1);
            ps.setInt(2, 2);
            ps.setString(3, "x");
            ps.setNull(4, Types.BOOLEAN);
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                expectEq(rs.getInt(1), 3, "sum");
                expectEq(rs.getString(2), "x", "text");
                rs.getBoolean(3);
                expect(rs.wasNull(), "null");
            }
        }
        return "";
    }

    static String prepared() throws Exception {
        try (Connection c = connect(); PreparedStatement ps = c.prepareStatement("SELECT ?::int * 2")) {
            for (int i = 0; i < 10; i++) {
                ps.setInt(1, i);
                try (ResultSet rs = ps.executeQuery()) { rs.next(); expectEq(rs.getInt(1), i * 2, "execution " + i); }
            }
        }
        return "";
    }

    // preparedServer: the statement becomes a named server-side statement
    // once it has run prepareThreshold times (never at 0 or in simple mode).
    static String preparedServer() throws Exception {
        try (Connection c = connect(); PreparedStatement ps = c.prepareStatement("SELECT ?::int + 1")) {
            int t = threshold();
            for (int i = 1; i <= 6; i++) {
                ps.setInt(1, i);
                ps.executeQuery().close();
                boolean want = !simpleMode() && t != 0 && (t < 0 || i >= t);
                long n = (Long) one(c, "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'SELECT $1::int + 1%'");
                expectEq(n > 0, want, "named server-side statement after " + i + " executions (threshold " + t + ")");
            }
        }
        return "";
    }

    static String binary() throws Exception {
        OffsetDateTime ts = OffsetDateTime.of(2026, 1, 2, 3, 4, 5, 678901000, ZoneOffset.UTC);
        UUID id = UUID.fromString("4d3b1f1e-2c8a-4e57-9a5c-0e7f1a2b3c4d");
        try (Connection c = connect();
             PreparedStatement ps = c.prepareStatement("SELECT CAST(? AS int8), CAST(? AS text), CAST(? AS bytea), CAST(? AS numeric), CAST(? AS timestamptz), CAST(? AS uuid), CAST(? AS float8), '{1,NULL,3}'::int4[]")) {
            for (int i = 0; i < 6; i++) { // past the threshold: binary results where the mode allows
                ps.setLong(1, 1L << 40);
                ps.setString(2, "héllo");
                setBytea(ps, 3, new byte[] {0, 1, (byte) 255});
                ps.setBigDecimal(4, new BigDecimal("12345.6789"));
                ps.setObject(5, ts);
                ps.setObject(6, id);
                ps.setDouble(7, 1.5);
                try (ResultSet rs = ps.executeQuery()) {
                    rs.next();
                    expectEq(rs.getLong(1), 1L << 40, "int8");
                    expectEq(rs.getString(2), "héllo", "text");
                    expect(Arrays.equals(rs.getBytes(3), new byte[] {0, 1, (byte) 255}), "bytea");
                    expectEq(rs.getBigDecimal(4), new BigDecimal("12345.6789"), "numeric");
                    expectEq(rs.getObject(5, OffsetDateTime.class), ts, "timestamptz");
                    expectEq(rs.getObject(6), id, "uuid");
                    expectEq(rs.getDouble(7), 1.5, "float8");
                    expectEq(Arrays.toString((Integer[]) rs.getArray(8).getArray()), "[1, null, 3]", "int4[]");
                }
            }
        }
        return "binaryTransfer=" + mode.getProperty("binaryTransfer", "true");
    }

    static String transaction() throws Exception {
        String t = "jdbc_tx_" + slug();
        try (Connection c = connect(); Connection obs = observer(); Statement s = c.createStatement()) {
            s.execute("CREATE TABLE " + t + " (v int)");
            c.setAutoCommit(false);
            s.execute("INSERT INTO " + t + " VALUES (1)");
            expectEq(one(obs, "SELECT count(*) FROM " + t), 0L, "uncommitted row seen elsewhere");
            c.commit();
            s.execute("INSERT INTO " + t + " VALUES (2)");
            c.rollback();
            expectEq(one(obs, "SELECT string_agg(v::text, ',') FROM " + t), "1", "rows");
        }
        return "";
    }

    static String savepoint() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            s.execute("CREATE TEMP TABLE sp (v int)");
            c.setAutoCommit(false);
            s.execute("INSERT INTO sp VALUES (1)");
            Savepoint sp = c.setSavepoint();
            s.execute("INSERT INTO sp VALUES (2)");
            expectEq(sqlstateOf(() -> s.execute("SELECT 1/0")), "22012", "error in the savepoint");
            c.rollback(sp);
            s.execute("INSERT INTO sp VALUES (3)");
            c.commit();
            expectEq(one(c, "SELECT string_agg(v::text, ',' ORDER BY v) FROM sp"), "1,3", "rows");
        }
        return "";
    }

    static String errorRecovery() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            s.execute("CREATE TEMP TABLE er (v int PRIMARY KEY)");
            s.execute("INSERT INTO er VALUES (1)");
            c.setAutoCommit(false);
            try (PreparedStatement ps = c.prepareStatement("INSERT INTO er VALUES (?)")) {
                ps.setInt(1, 1);
                expectEq(sqlstateOf(ps::executeUpdate), "23505", "duplicate key");
            }
            expectEq(sqlstateOf(() -> s.execute("SELECT 1")), "25P02", "a statement in a failed transaction");
            c.rollback();
            expectEq(one(c, "SELECT 1"), 1, "after rollback");
            expectEq(sqlstateOf(() -> one(c, "SELECT ?::int", "nope")), "22P02", "a bad parameter");
            c.rollback();
            expectEq(one(c, "SELECT count(*) FROM er"), 1L, "rows");
        }
        return "";
    }

    // syntaxError: a typo in a statement with one string literal (its text
    // unique to the variant: the proxy caches classifications by text).
    static String syntaxError() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            expectEq(sqlstateOf(() -> s.execute("SELEC '" + variant + "'")), "42601", "a syntax error");
            expectEq(sqlstateOf(() -> one(c, "SELEC '" + variant + "', CAST(? AS int)", 1)), "42601", "a syntax error with a parameter");
            expectEq(one(c, "SELECT 1"), 1, "after the syntax errors");
        }
        return "";
    }

    static String notice() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            s.execute("DO $$ BEGIN RAISE NOTICE 'hello %', 42; RAISE WARNING 'careful' USING ERRCODE = '01XYZ'; END $$");
            List<String> got = new ArrayList<>();
            for (SQLWarning w = s.getWarnings(); w != null; w = w.getNextWarning()) got.add(w.getSQLState() + " " + w.getMessage());
            expectEq(got, List.of("00000 hello 42", "01XYZ careful"), "warnings");
        }
        return "";
    }

    static List<PGNotification> notifications(Connection c, int n) throws Exception {
        List<PGNotification> got = new ArrayList<>();
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (got.size() < n && System.nanoTime() < deadline) {
            PGNotification[] ns = c.unwrap(PGConnection.class).getNotifications(500);
            if (ns != null) got.addAll(Arrays.asList(ns));
        }
        return got;
    }

    static String listenNotify() throws Exception {
        String ch = "jdbc_" + slug().toLowerCase();
        try (Connection a = connect(); Connection b = connect(); Statement sa = a.createStatement(); Statement sb = b.createStatement()) {
            sa.execute("LISTEN " + ch);
            sb.execute("NOTIFY " + ch + ", 'hello'");
            one(b, "SELECT pg_notify(?, ?)", ch, "from function");
            List<String> got = new ArrayList<>();
            for (PGNotification x : notifications(a, 2)) got.add(x.getName() + ":" + x.getParameter());
            expectEq(got, List.of(ch + ":hello", ch + ":from function"), "notifications");
        }
        return "";
    }

    static String copyOut() throws Exception {
        try (Connection c = connect()) {
            ByteArrayOutputStream out = new ByteArrayOutputStream();
            long n = c.unwrap(PGConnection.class).getCopyAPI().copyOut("COPY (SELECT g, 'row ' || g FROM generate_series(1, 1000) g) TO STDOUT", out);
            expectEq(n, 1000L, "rows");
            String[] lines = out.toString("UTF-8").split("\n");
            expectEq(lines[999], "1000\trow 1000", "last line");
        }
        return "";
    }

    static String copyIn() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            s.execute("CREATE TEMP TABLE ci (id int, name text)");
            StringBuilder b = new StringBuilder();
            for (int i = 1; i <= 1000; i++) b.append(i).append("\tname ").append(i).append('\n');
            CopyManager cm = c.unwrap(PGConnection.class).getCopyAPI();
            expectEq(cm.copyIn("COPY ci FROM STDIN", new StringReader(b.toString())), 1000L, "rows copied");
            expectEq(sqlstateOf(() -> cm.copyIn("COPY ci FROM STDIN", new StringReader("x\ty\n"))), "22P02", "bad COPY data");
            expectEq(one(c, "SELECT count(*) || ' ' || sum(id) FROM ci"), "1000 500500", "rows");
        }
        return "";
    }

    static String cancel() throws Exception {
        String app = "jdbccancel-" + UUID.randomUUID().toString().substring(0, 8);
        try (Connection c = connect("ApplicationName", app); Connection obs = observer(); Statement s = c.createStatement()) {
            AtomicReference<String> code = new AtomicReference<>("none");
            Thread th = new Thread(() -> {
                try {
                    code.set(sqlstateOf(() -> s.execute("SELECT pg_sleep(60)")));
                } catch (Exception e) {
                    code.set(e.toString());
                }
            });
            th.start();
            waitUntil("the query to run", () -> (Long) one(obs,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = ? AND state = 'active' AND query LIKE '%pg_sleep%'", app) == 1L);
            s.cancel();
            th.join(20000);
            expectEq(code.get(), "57014", "the cancelled query's SQLSTATE");
            expectEq(one(c, "SELECT 1"), 1, "after the cancel");
        }
        return "";
    }

    static String statementTimeout() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            s.execute("SET statement_timeout = '100ms'");
            expectEq(sqlstateOf(() -> s.execute("SELECT pg_sleep(10)")), "57014", "the timed-out query");
            expectEq(one(c, "SELECT 1"), 1, "after the timeout");
        }
        return "";
    }

    static String serverCursor() throws Exception {
        try (Connection c = connect()) {
            c.setAutoCommit(false); // fetchSize needs a transaction: a portal read 100 rows at a time
            try (PreparedStatement ps = c.prepareStatement("SELECT g FROM generate_series(1, ?) g")) {
                ps.setFetchSize(100);
                ps.setInt(1, 1000);
                long sum = 0;
                try (ResultSet rs = ps.executeQuery()) {
                    while (rs.next()) sum += rs.getInt(1);
                }
                expectEq(sum, 500500L, "sum over the portal");
            }
            c.commit();
            try (Statement s = c.createStatement()) {
                s.execute("DECLARE jc CURSOR FOR SELECT g FROM generate_series(1, 10) g");
                try (ResultSet rs = s.executeQuery("FETCH 3 FROM jc")) {
                    int n = 0;
                    while (rs.next()) n++;
                    expectEq(n, 3, "FETCH");
                }
            }
            c.commit();
        }
        return simpleMode() ? "simple mode: fetchSize reads everything at once" : "fetchSize (portal row limits) and DECLARE/FETCH";
    }

    static String pool() throws Exception {
        PGConnectionPoolDataSource ds = new PGConnectionPoolDataSource();
        ds.setServerNames(new String[] {HOST});
        ds.setPortNumbers(new int[] {Integer.parseInt(PORT)});
        ds.setDatabaseName(DB);
        ds.setUser("postgres");
        ds.setProperty("sslmode", "disable");
        for (String k : mode.stringPropertyNames()) ds.setProperty(k, mode.getProperty(k));
        BlockingQueue<PooledConnection> pool = new ArrayBlockingQueue<>(3);
        for (int i = 0; i < 3; i++) pool.add(ds.getPooledConnection());
        ExecutorService ex = Executors.newFixedThreadPool(6);
        try {
            List<Future<?>> fs = new ArrayList<>();
            for (int i = 0; i < 6; i++) {
                final int w = i;
                fs.add(ex.submit(() -> {
                    for (int j = 0; j < 5; j++) {
                        PooledConnection pc = pool.take();
                        try (Connection c = pc.getConnection()) { // a logical connection of the pooled one
                            expectEq(one(c, "SELECT ?::int + ?", w, j), w + j, "answer");
                        } finally {
                            pool.put(pc);
                        }
                    }
                    return null;
                }));
            }
            for (Future<?> f : fs) f.get(60, TimeUnit.SECONDS);
        } finally {
            ex.shutdownNow();
            for (PooledConnection pc : pool) pc.close();
        }
        return "PGConnectionPoolDataSource";
    }

    static String pipeline() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement()) {
            s.execute("CREATE TEMP TABLE pl (id int PRIMARY KEY, v text)");
            try (PreparedStatement ps = c.prepareStatement("INSERT INTO pl VALUES (?, ?)")) {
                for (int i = 0; i < 200; i++) { ps.setInt(1, i); ps.setString(2, "v" + i); ps.addBatch(); }
                int[] n = ps.executeBatch();
                expectEq(n.length, 200, "batch results");
                ps.setInt(1, 1000); ps.setString(2, "a"); ps.addBatch();
                ps.setInt(1, 1); ps.setString(2, "dup"); ps.addBatch();
                ps.setInt(1, 1001); ps.setString(2, "b"); ps.addBatch();
                String code = null;
                try {
                    ps.executeBatch();
                } catch (BatchUpdateException e) {
                    code = e.getSQLState() != null ? e.getSQLState() : e.getNextException().getSQLState();
                }
                expectEq(code, "23505", "error in the batch");
            }
            s.addBatch("INSERT INTO pl VALUES (5000, 'x')");
            s.addBatch("UPDATE pl SET v = 'y' WHERE id = 5000");
            expectEq(Arrays.toString(s.executeBatch()), "[1, 1]", "statement batch");
            // An autocommit batch is one implicit transaction: the error
            // rolled back all three; in simple mode each is a query of its
            // own, and the batch goes on after the error.
            expectEq(one(c, "SELECT count(*) FROM pl"), simpleMode() ? 203L : 201L, "rows");
        }
        return "executeBatch";
    }

    static String largeValue() throws Exception {
        StringBuilder b = new StringBuilder(8 << 20);
        for (int i = 0; i < (8 << 20); i++) b.append('x');
        String text = b.append("end").toString();
        byte[] blob = new byte[4 << 20];
        new Random(1).nextBytes(blob);
        try (Connection c = connect(); PreparedStatement ps = c.prepareStatement("SELECT CAST(? AS text), md5(CAST(? AS text)), CAST(? AS bytea)")) {
            ps.setString(1, text);
            ps.setString(2, text);
            setBytea(ps, 3, blob);
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                expect(rs.getString(1).equals(text), "text value changed");
                expectEq(rs.getString(2), hex(MessageDigest.getInstance("MD5").digest(text.getBytes("UTF-8"))), "server-side md5");
                expect(Arrays.equals(rs.getBytes(3), blob), "bytea value changed");
            }
        }
        return "";
    }

    // setBytea binds a bytea; pgjdbc's simple mode cannot inline setBytes
    // (it leaves the ? in the query), so there it goes as hex text.
    static void setBytea(PreparedStatement ps, int i, byte[] b) throws SQLException {
        if (simpleMode()) {
            ps.setString(i, "\\x" + hex(b));
        } else {
            ps.setBytes(i, b);
        }
    }

    static String hex(byte[] b) {
        StringBuilder s = new StringBuilder();
        for (byte x : b) {
            s.append(Character.forDigit((x >> 4) & 0xf, 16)).append(Character.forDigit(x & 0xf, 16));
        }
        return s.toString();
    }

    static String largeResult() throws Exception {
        try (Connection c = connect(); Statement s = c.createStatement();
             ResultSet rs = s.executeQuery("SELECT g, repeat('x', 100) FROM generate_series(1, 100000) g")) {
            int n = 0, last = 0;
            while (rs.next()) { n++; last = rs.getInt(1); }
            expectEq(n, 100000, "rows");
            expectEq(last, 100000, "last row");
        }
        return "";
    }

    static String clientEncoding() throws Exception {
        try (Connection c = connect(); PreparedStatement ps = c.prepareStatement("SELECT ?::text, octet_length(?::text)")) {
            ps.setString(1, "漢字 café 🐘");
            ps.setString(2, "漢字 café 🐘");
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                expectEq(rs.getString(1), "漢字 café 🐘", "UTF8 text");
                expectEq(rs.getInt(2), 17, "octets");
            }
        }
        return "UTF8 only: pgjdbc refuses another client_encoding";
    }

    static String backendPid() throws Exception {
        String app = "jdbcpid-" + UUID.randomUUID().toString().substring(0, 8);
        try (Connection c = connect("ApplicationName", app); Connection obs = observer(); Statement s = c.createStatement()) {
            int pid = c.unwrap(PGConnection.class).getBackendPID();
            expectEq(one(c, "SELECT pg_backend_pid()"), pid, "pg_backend_pid() against the driver's BackendKeyData PID");
            expectEq(one(obs, "SELECT pid FROM pg_stat_activity WHERE application_name = ?", app), pid, "pg_stat_activity's pid against the driver's");
            s.execute("LISTEN jdbc_self");
            s.execute("NOTIFY jdbc_self");
            List<PGNotification> got = notifications(c, 1);
            expect(!got.isEmpty(), "no self-notification");
            expectEq(got.get(0).getPID(), pid, "PID of a self-notification");
        }
        return "";
    }

    // --- fencing flows -------------------------------------------------------

    static String jobKey(String check) {
        return slug() + ":" + check;
    }

    static long[] acquire(String job) throws Exception {
        try (Connection obs = observer(); PreparedStatement ps = obs.prepareStatement("SELECT epoch, token FROM fence.acquire(?, 'h1', interval '5 minutes')")) {
            ps.setString(1, job);
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                return new long[] {rs.getLong(1), rs.getLong(2)};
            }
        }
    }

    static Connection fenced(String job, long epoch, long token) throws SQLException {
        return connect("options", "-c fence.job_key=" + job + " -c fence.epoch=" + epoch + " -c fence.token=" + token);
    }

    // The digest versions of job's receipts: the proxy's v1, or straight to
    // PostgreSQL the backstop's backstop-v1.
    static String receiptKinds(String job) throws Exception {
        try (Connection obs = observer()) {
            return (String) one(obs, "SELECT coalesce(string_agg(digest_version, ',' ORDER BY token), '') FROM fence.receipts WHERE job_key = ?", job);
        }
    }

    static long receipts(String job) throws Exception {
        try (Connection obs = observer()) {
            return (Long) one(obs, "SELECT count(*) FROM fence.receipts WHERE job_key = ?", job);
        }
    }

    static String resultRow(String job) throws Exception {
        try (Connection obs = observer()) {
            return (String) one(obs, "SELECT payload || ' ' || token FROM results WHERE job_key = ?", job);
        }
    }

    static void upsert(Connection c, String job, String payload, long token) throws SQLException {
        try (PreparedStatement ps = c.prepareStatement(UPSERT)) {
            ps.setString(1, job);
            ps.setString(2, payload);
            ps.setLong(3, token);
            ps.executeUpdate();
        }
    }

    // commitOnce writes in a transaction of its own; it returns the warnings
    // of the COMMIT (the replay NOTICE).
    static List<String> commitOnce(String job, long epoch, long token, String payload) throws Exception {
        try (Connection c = fenced(job, epoch, token)) {
            c.setAutoCommit(false);
            upsert(c, job, payload, token);
            c.commit();
            List<String> got = new ArrayList<>();
            for (SQLWarning w = c.getWarnings(); w != null; w = w.getNextWarning()) got.add(w.getSQLState());
            return got;
        }
    }

    static long[] committedGeneration(String check) throws Exception {
        String job = jobKey(check);
        long[] g = acquire(job);
        commitOnce(job, g[0], g[1], "p1");
        return g;
    }

    static String fenceAcquire() throws Exception {
        String job = jobKey("acquire");
        try (Connection c = connect()) {
            try (PreparedStatement ps = c.prepareStatement("SELECT epoch, token FROM fence.acquire(?, 'h1', interval '5 minutes')")) {
                ps.setString(1, job);
                try (ResultSet rs = ps.executeQuery()) {
                    rs.next();
                    expect(rs.getLong(1) >= 1 && rs.getLong(2) >= 1, "epoch and token");
                }
            }
            expectEq(sqlstateOf(() -> one(c, "SELECT token FROM fence.acquire(?, 'h2', interval '5 minutes')", job)), "FN002", "a second holder's acquire");
        }
        return "";
    }

    static String fenceCommit() throws Exception {
        long[] g = committedGeneration("commit");
        expectEq(resultRow(jobKey("commit")), "p1 " + g[1], "the committed row");
        expectEq(receiptKinds(jobKey("commit")), PROXY ? "v1" : "backstop-v1", "receipts (digest versions)");
        return "";
    }

    static String fenceReplay() throws Exception {
        if (!PROXY) throw new NotApplicable("receipts are written by the proxy");
        String job = jobKey("replay");
        long[] g = committedGeneration("replay");
        List<String> warnings = commitOnce(job, g[0], g[1], "p1");
        expectEq(warnings, List.of("FN00R"), "warnings of the retried commit");
        expectEq(receipts(job), 1L, "receipts");
        expectEq(resultRow(job), "p1 " + g[1], "the row");
        return "";
    }

    static String fenceConflict() throws Exception {
        if (!PROXY) throw new NotApplicable("receipts are written by the proxy");
        String job = jobKey("conflict");
        long[] g = committedGeneration("conflict");
        try (Connection c = fenced(job, g[0], g[1])) {
            c.setAutoCommit(false);
            upsert(c, job, "something else", g[1]);
            expectEq(sqlstateOf(c::commit), "FN003", "a different payload under a committed generation");
            c.setAutoCommit(true);
            expectEq(one(c, "SELECT 1"), 1, "after the conflict");
        }
        expectEq(resultRow(job), "p1 " + g[1], "the row");
        return "";
    }

    static String fenceStale() throws Exception {
        String job = jobKey("stale");
        long[] g = acquire(job);
        try (Connection obs = observer()) {
            one(obs, "SELECT fence.release(?, ?)", job, g[1]);
            one(obs, "SELECT token FROM fence.acquire(?, 'h2', interval '5 minutes')", job);
        }
        try (Connection c = fenced(job, g[0], g[1])) {
            c.setAutoCommit(false);
            String code = sqlstateOf(() -> upsert(c, job, "zombie", g[1]));
            if (code == null) code = sqlstateOf(c::commit);
            expectEq(code, "FN001", "a write under the token taken over");
            c.rollback();
            expectEq(one(c, "SELECT 1"), 1, "after FN001");
        }
        expectEq(resultRow(job), null, "the row");
        return "";
    }

    static String fenceAutocommit() throws Exception {
        String job = jobKey("autocommit");
        long[] g = acquire(job);
        try (Connection c = fenced(job, g[0], g[1])) {
            upsert(c, job, "auto", g[1]);
        }
        expectEq(resultRow(job), "auto " + g[1], "the row");
        expectEq(receiptKinds(job), PROXY ? "v1" : "backstop-v1", "receipts (digest versions)");
        return "";
    }

    static String fenceCopy() throws Exception {
        String job = jobKey("copy");
        long[] g = acquire(job);
        try (Connection c = fenced(job, g[0], g[1])) {
            c.unwrap(PGConnection.class).getCopyAPI().copyIn("COPY results (job_key, payload, token) FROM STDIN",
                new StringReader(job + "\tcopied\t" + g[1] + "\n"));
        }
        expectEq(resultRow(job), "copied " + g[1], "the row");
        expectEq(receiptKinds(job), PROXY ? "v1" : "backstop-v1", "receipts (digest versions)");
        return "";
    }

    static String fenceNoMetadata() throws Exception {
        try (Connection c = connect()) {
            expectEq(sqlstateOf(() -> upsert(c, jobKey("nometa"), "x", 1)), "FN008", "a write without fence metadata");
        }
        expectEq(resultRow(jobKey("nometa")), null, "the row");
        return "";
    }

    static String fencePipeline() throws Exception {
        String job = jobKey("pipeline");
        long[] g = acquire(job);
        // In simple mode pgjdbc sends each entry as a query of its own, so in
        // autocommit they would be three transactions under one generation
        // and step: the second a replay (straight to PostgreSQL its COMMIT
        // fails with FN00R). There the batch runs in one transaction.
        boolean simple = "simple".equals(mode.getProperty("preferQueryMode"));
        try (Connection c = fenced(job, g[0], g[1]); PreparedStatement ps = c.prepareStatement(UPSERT)) {
            if (simple) c.setAutoCommit(false);
            for (int i = 0; i < 3; i++) {
                ps.setString(1, job);
                ps.setString(2, "batch");
                ps.setLong(3, g[1]);
                ps.addBatch();
            }
            ps.executeBatch();
            if (simple) c.commit();
        }
        expectEq(resultRow(job), "batch " + g[1], "the row");
        expectEq(receiptKinds(job), PROXY ? "v1" : "backstop-v1", "receipts (digest versions)");
        return simple ? "executeBatch in a transaction (simple mode: one query per entry)" : "executeBatch in autocommit";
    }

    static final Object[][] CHECKS = {
        {"connect", (Check) Checks::connectCheck},
        {"simple_query", (Check) Checks::simpleQuery},
        {"extended_query", (Check) Checks::extendedQuery},
        {"prepared", (Check) Checks::prepared},
        {"prepared_server", (Check) Checks::preparedServer},
        {"binary", (Check) Checks::binary},
        {"transaction", (Check) Checks::transaction},
        {"savepoint", (Check) Checks::savepoint},
        {"error_recovery", (Check) Checks::errorRecovery},
        {"syntax_error", (Check) Checks::syntaxError},
        {"notice", (Check) Checks::notice},
        {"listen_notify", (Check) Checks::listenNotify},
        {"copy_out", (Check) Checks::copyOut},
        {"copy_in", (Check) Checks::copyIn},
        {"cancel", (Check) Checks::cancel},
        {"statement_timeout", (Check) Checks::statementTimeout},
        {"server_cursor", (Check) Checks::serverCursor},
        {"pool", (Check) Checks::pool},
        {"pipeline", (Check) Checks::pipeline},
        {"large_value", (Check) Checks::largeValue},
        {"large_result", (Check) Checks::largeResult},
        {"client_encoding", (Check) Checks::clientEncoding},
        {"backend_pid", (Check) Checks::backendPid},
        {"fence_acquire", (Check) Checks::fenceAcquire},
        {"fence_commit", (Check) Checks::fenceCommit},
        {"fence_replay", (Check) Checks::fenceReplay},
        {"fence_conflict", (Check) Checks::fenceConflict},
        {"fence_stale", (Check) Checks::fenceStale},
        {"fence_autocommit", (Check) Checks::fenceAutocommit},
        {"fence_copy", (Check) Checks::fenceCopy},
        {"fence_no_metadata", (Check) Checks::fenceNoMetadata},
        {"fence_pipeline", (Check) Checks::fencePipeline},
    };

    static String clean(String s) {
        return String.join(" ", (s == null ? "" : s).trim().split("\\s+"));
    }

    public static void main(String[] args) {
        for (String[] v : VARIANTS) {
            variant = v[0];
            mode = new Properties();
            for (int i = 1; i + 1 < v.length; i += 2) mode.setProperty(v[i], v[i + 1]);
            for (Object[] c : CHECKS) {
                String status = "ok", detail;
                try {
                    detail = ((Check) c[1]).run();
                } catch (NotApplicable e) {
                    status = "n/a";
                    detail = e.getMessage();
                } catch (Throwable e) {
                    status = "fail";
                    detail = e instanceof SQLException ? ((SQLException) e).getSQLState() + ": " + e.getMessage() : e.toString();
                    System.err.println(variant + " " + c[0] + ":");
                    e.printStackTrace();
                }
                String d = clean(detail);
                System.out.println("check\t" + variant + "\t" + c[0] + "\t" + status + "\t" + (d.length() > 500 ? d.substring(0, 500) : d));
            }
        }
    }
}
