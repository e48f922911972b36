// node-postgres's checks of the driver matrix (internal/drivers).
//
// node-postgres sends a query without parameters as a simple Query and one
// with parameters through the extended protocol (an unnamed statement, or a
// named one when the query has a name); pipeline: true sends queries
// without waiting for the previous answer. pg-cursor reads through a portal
// with a row limit; pg-copy-streams does COPY. The connection comes from
// libpq's PG* environment variables, which node-postgres reads too.
//
// Prints one line per check: check TAB variant TAB name TAB ok|fail|n/a TAB detail.
'use strict'

const crypto = require('crypto')
const { pipeline: streamPipeline } = require('stream/promises')
const { Readable, Writable } = require('stream')
const pg = require('pg')
const Cursor = require('pg-cursor')
const copyStreams = require('pg-copy-streams')

const VARIANT = 'node-postgres'
const PROXY = process.env.PGFENCE_TARGET === 'proxy'
const OBSERVER_PORT = Number(process.env.PGFENCE_OBSERVER_PORT)
const UPSERT =
  'INSERT INTO results (job_key, payload, token) VALUES ($1, $2, $3) ' +
  'ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token ' +
  'WHERE results.token < excluded.token'

class NotApplicable extends Error {}

function expect(cond, msg) {
  if (!cond) throw new Error(msg)
}

function expectEq(got, want, what) {
  const g = JSON.stringify(got)
  const w = JSON.stringify(want)
  if (g !== w) throw new Error(`${what}: got ${g}, want ${w}`)
}

async function connect(config = {}) {
  const c = new pg.Client(config)
  // A connection that ends under a query fails the query; without a
  // listener its 'error' event would end the process.
  c.on('error', () => {})
  await c.connect()
  return c
}

function observer() {
  return connect({ port: OBSERVER_PORT })
}

// withClients opens the clients, runs f, and closes them whatever happens.
async function withClients(configs, f) {
  const clients = []
  try {
    for (const cfg of configs) clients.push(await connect(cfg))
    return await f(...clients)
  } finally {
    for (const c of clients) await c.end().catch(() => {})
  }
}

async function sqlstateOf(p) {
  try {
    await p
  } catch (e) {
    return e.code || `no SQLSTATE: ${e.message}`
  }
  return null
}

async function waitUntil(what, cond, timeoutMs = 10000) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    if (await cond()) return
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 10))
  }
}

const checks = {
  async connect() {
    await withClients([{}], async (c) => {
      const r = await c.query('SELECT current_setting($1)::int AS v', ['server_version_num'])
      expect(r.rows[0].v >= 150000, `server_version_num ${r.rows[0].v}`)
    })
  },

  async simple_query() {
    await withClients([{}], async (c) => {
      const rs = await c.query("SELECT 1 AS a; SELECT 'two' AS b")
      expectEq(rs.map((r) => r.rows), [[{ a: 1 }], [{ b: 'two' }]], 'results of a multi-statement query')
    })
  },

  async extended_query() {
    await withClients([{}], async (c) => {
      const r = await c.query('SELECT $1::int + $2::int AS s, $3::text AS t, $4::bool AS n', [1, 2, 'x', null])
      expectEq(r.rows, [{ s: 3, t: 'x', n: null }], 'row')
      expectEq(await sqlstateOf(c.query('SELECT 1; SELECT $1::int', [1])), '42601', 'two statements with parameters')
    })
  },

  async prepared() {
    await withClients([{}], async (c) => {
      for (let i = 0; i < 3; i++) {
        const r = await c.query({ name: 'double', text: 'SELECT $1::int * 2 AS v', values: [i] })
        expectEq(r.rows[0].v, i * 2, 'named statement')
      }
      const r = await c.query("SELECT count(*)::int AS n FROM pg_prepared_statements WHERE name = 'double'")
      expectEq(r.rows[0].n, 1, 'server-side statements')
    })
    return 'named queries are prepared server-side once'
  },

  async prepared_server() {
    throw new NotApplicable('node-postgres prepares only named queries, always (no threshold)')
  },

  async binary() {
    await withClients([{}], async (c) => {
      // pg-types decodes few types from binary: int4, int8 (as a string), text.
      const r = await c.query({ text: 'SELECT $1::int4 AS i, $2::text AS t, $3::int8 AS l', values: [7, 'héllo', '1099511627776'], binary: true })
      expectEq(r.fields.map((f) => f.format), ['binary', 'binary', 'binary'], 'result formats')
      expectEq(r.rows[0], { i: 7, t: 'héllo', l: '1099511627776' }, 'row')
    })
  },

  async transaction() {
    await withClients([{}, { port: OBSERVER_PORT }], async (c, obs) => {
      await c.query('CREATE TABLE node_tx (v int)')
      await c.query('BEGIN')
      await c.query('INSERT INTO node_tx VALUES ($1)', [1])
      expectEq((await obs.query('SELECT count(*)::int AS n FROM node_tx')).rows[0].n, 0, 'uncommitted row seen elsewhere')
      await c.query('COMMIT')
      await c.query('BEGIN')
      await c.query('INSERT INTO node_tx VALUES ($1)', [2])
      await c.query('ROLLBACK')
      expectEq((await obs.query('SELECT array_agg(v) AS a FROM node_tx')).rows[0].a, [1], 'rows')
    })
  },

  async savepoint() {
    await withClients([{}], async (c) => {
      await c.query('CREATE TEMP TABLE sp (v int)')
      await c.query('BEGIN')
      await c.query('INSERT INTO sp VALUES (1)')
      await c.query('SAVEPOINT a')
      await c.query('INSERT INTO sp VALUES ($1)', [2])
      expectEq(await sqlstateOf(c.query('SELECT 1/0')), '22012', 'error in the savepoint')
      await c.query('ROLLBACK TO SAVEPOINT a')
      await c.query('INSERT INTO sp VALUES ($1)', [3])
      await c.query('COMMIT')
      expectEq((await c.query('SELECT array_agg(v ORDER BY v) AS a FROM sp')).rows[0].a, [1, 3], 'rows')
    })
  },

  async error_recovery() {
    await withClients([{}], async (c) => {
      await c.query('CREATE TEMP TABLE er (v int PRIMARY KEY)')
      await c.query('INSERT INTO er VALUES (1)')
      await c.query('BEGIN')
      let err
      try {
        await c.query('INSERT INTO er VALUES ($1)', [1])
      } catch (e) {
        err = e
      }
      expect(err && err.code === '23505' && err.constraint === 'er_pkey', `duplicate key: ${err && err.code} ${err && err.constraint}`)
      expectEq(await sqlstateOf(c.query('SELECT 1')), '25P02', 'a statement in a failed transaction')
      await c.query('ROLLBACK')
      expectEq(await sqlstateOf(c.query('SELECT $1::int', ['nope'])), '22P02', 'a bad parameter')
      expectEq(await sqlstateOf(c.query('SELEC 1')), '42601', 'a syntax error')
      expectEq((await c.query('SELECT count(*)::int AS n FROM er')).rows[0].n, 1, 'rows')
    })
  },

  async syntax_error() {
    // A typo in a statement with one string literal, simple and extended
    // (its text unique to the driver: the proxy caches classifications by text).
    await withClients([{}], async (c) => {
      expectEq(await sqlstateOf(c.query(`SELEC '${VARIANT}'`)), '42601', 'a syntax error')
      expectEq(await sqlstateOf(c.query(`SELEC '${VARIANT}', $1::int`, [1])), '42601', 'a syntax error with a parameter')
      expectEq((await c.query('SELECT 1 AS v')).rows[0].v, 1, 'after the syntax errors')
    })
  },

  async notice() {
    await withClients([{}], async (c) => {
      const got = []
      c.on('notice', (n) => got.push([n.severity, n.code, n.message]))
      await c.query("DO $$ BEGIN RAISE NOTICE 'hello %', 42; RAISE WARNING 'careful' USING ERRCODE = '01XYZ'; END $$")
      expectEq(got, [['NOTICE', '00000', 'hello 42'], ['WARNING', '01XYZ', 'careful']], 'notices')
    })
  },

  async listen_notify() {
    await withClients([{}, {}], async (a, b) => {
      const got = []
      a.on('notification', (n) => got.push([n.channel, n.payload]))
      await a.query('LISTEN node_chan')
      await b.query("NOTIFY node_chan, 'hello'")
      await b.query('SELECT pg_notify($1, $2)', ['node_chan', 'from function'])
      await waitUntil('notifications', () => got.length >= 2)
      expectEq(got, [['node_chan', 'hello'], ['node_chan', 'from function']], 'notifications')
    })
  },

  async copy_out() {
    await withClients([{}], async (c) => {
      const chunks = []
      const stream = c.query(copyStreams.to("COPY (SELECT g, 'row ' || g FROM generate_series(1, 1000) g) TO STDOUT"))
      await streamPipeline(stream, new Writable({ write(chunk, _, cb) { chunks.push(chunk); cb() } }))
      const lines = Buffer.concat(chunks).toString().trimEnd().split('\n')
      expectEq(lines.length, 1000, 'lines')
      expectEq(lines[999], '1000\trow 1000', 'last line')
    })
  },

  async copy_in() {
    await withClients([{}], async (c) => {
      await c.query('CREATE TEMP TABLE ci (id int, name text)')
      const rows = []
      for (let i = 1; i <= 1000; i++) rows.push(`${i}\tname ${i}\n`)
      await streamPipeline(Readable.from(rows), c.query(copyStreams.from('COPY ci FROM STDIN')))
      const bad = streamPipeline(Readable.from(['x\ty\n']), c.query(copyStreams.from('COPY ci FROM STDIN')))
      expectEq(await sqlstateOf(bad), '22P02', 'bad COPY data')
      expectEq((await c.query('SELECT count(*)::int AS n, sum(id)::int AS s FROM ci')).rows[0], { n: 1000, s: 500500 }, 'rows')
    })
  },

  async cancel() {
    const app = 'nodecancel-' + crypto.randomBytes(4).toString('hex')
    await withClients([{ application_name: app }, { port: OBSERVER_PORT }], async (c, obs) => {
      const q = c.query('SELECT pg_sleep(60)')
      const code = sqlstateOf(q)
      await waitUntil('the query to run', async () => {
        const r = await obs.query("SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND state = 'active' AND query LIKE '%pg_sleep%'", [app])
        return r.rows[0].n === 1
      })
      // node-postgres's cancel: a CancelRequest with the connection's key.
      const canceller = new pg.Client()
      canceller.cancel(c, c.activeQuery)
      expectEq(await code, '57014', "the cancelled query's SQLSTATE")
      expectEq((await c.query('SELECT 1 AS v')).rows[0].v, 1, 'after the cancel')
    })
  },

  async statement_timeout() {
    await withClients([{ statement_timeout: 100 }], async (c) => {
      expectEq(await sqlstateOf(c.query('SELECT pg_sleep(10)')), '57014', 'the timed-out query')
      expectEq((await c.query('SELECT 1 AS v')).rows[0].v, 1, 'after the timeout')
    })
    return 'statement_timeout in the startup packet'
  },

  async server_cursor() {
    await withClients([{}], async (c) => {
      const cursor = c.query(new Cursor('SELECT g FROM generate_series(1, $1::int) g', [1000]))
      let total = 0
      let n = 0
      for (;;) {
        const rows = await cursor.read(100)
        if (rows.length === 0) break
        n++
        for (const r of rows) total += r.g
      }
      await cursor.close()
      expectEq([total, n], [500500, 10], 'sum and reads through the portal')
      await c.query('BEGIN')
      await c.query('DECLARE sc CURSOR FOR SELECT g FROM generate_series(1, 10) g')
      expectEq((await c.query('FETCH 3 FROM sc')).rows.map((r) => r.g), [1, 2, 3], 'FETCH')
      await c.query('COMMIT')
    })
    return 'pg-cursor (portal row limits) and DECLARE/FETCH'
  },

  async pool() {
    const pool = new pg.Pool({ max: 3 })
    try {
      const work = []
      for (let i = 0; i < 6; i++) {
        work.push((async () => {
          for (let j = 0; j < 5; j++) {
            const r = await pool.query('SELECT $1::int + $2::int AS s', [i, j])
            if (r.rows[0].s !== i + j) throw new Error('wrong answer')
          }
        })())
      }
      await Promise.all(work)
      const c = await pool.connect()
      await c.query('BEGIN')
      await c.query('SELECT 1')
      await c.query('COMMIT')
      c.release()
    } finally {
      await pool.end()
    }
  },

  async pipeline() {
    await withClients([{ pipeline: true }], async (c) => {
      await c.query('CREATE TEMP TABLE pl (id int PRIMARY KEY)')
      const qs = []
      for (let i = 0; i < 50; i++) qs.push(c.query('INSERT INTO pl VALUES ($1) RETURNING id', [i]))
      const dup = c.query('INSERT INTO pl VALUES ($1)', [1])
      const after = c.query('SELECT count(*)::int AS n FROM pl')
      const rs = await Promise.all(qs)
      expectEq(rs.map((r) => r.rows[0].id), [...Array(50).keys()], 'RETURNING ids')
      expectEq(await sqlstateOf(dup), '23505', 'error in the pipeline')
      expectEq((await after).rows[0].n, 50, 'after the error (each query has its own Sync)')
    })
    return 'pipeline: true'
  },

  async large_value() {
    await withClients([{}], async (c) => {
      const text = 'x'.repeat(8 << 20) + 'end'
      const blob = crypto.randomBytes(4 << 20)
      const r = await c.query('SELECT $1::text AS t, md5($1::text) AS m, $2::bytea AS b', [text, blob])
      expect(r.rows[0].t === text, 'text value changed')
      expectEq(r.rows[0].m, crypto.createHash('md5').update(text).digest('hex'), 'server-side md5')
      expect(Buffer.compare(r.rows[0].b, blob) === 0, 'bytea value changed')
    })
  },

  async large_result() {
    await withClients([{}], async (c) => {
      const r = await c.query("SELECT g, repeat('x', 100) AS x FROM generate_series(1, 100000) g")
      expectEq(r.rows.length, 100000, 'rows')
      expectEq(r.rows[99999].g, 100000, 'last row')
    })
  },

  async client_encoding() {
    await withClients([{}], async (c) => {
      const r = await c.query('SELECT $1::text AS t, octet_length($1::text) AS n', ['漢字 café 🐘'])
      expectEq(r.rows[0], { t: '漢字 café 🐘', n: 17 }, 'UTF8 text')
      expectEq((await c.query('SHOW client_encoding')).rows[0].client_encoding, 'UTF8', 'client_encoding')
    })
    return 'UTF8 only: node-postgres decodes everything as UTF-8'
  },

  async backend_pid() {
    const app = 'nodepid-' + crypto.randomBytes(4).toString('hex')
    await withClients([{ application_name: app }, { port: OBSERVER_PORT }], async (c, obs) => {
      const pid = c.processID
      expectEq((await c.query('SELECT pg_backend_pid() AS p')).rows[0].p, pid, "pg_backend_pid() against the driver's BackendKeyData PID")
      expectEq((await obs.query('SELECT pid FROM pg_stat_activity WHERE application_name = $1', [app])).rows[0].pid, pid, "pg_stat_activity's pid against the driver's")
      const got = []
      c.on('notification', (n) => got.push(n.processId))
      await c.query('LISTEN node_self')
      await c.query('NOTIFY node_self')
      await waitUntil('the self-notification', () => got.length >= 1)
      expectEq(got[0], pid, 'PID of a self-notification')
    })
  },

  // --- fencing flows ---------------------------------------------------------

  async fence_acquire() {
    const job = jobKey('acquire')
    await withClients([{}], async (c) => {
      const r = await c.query("SELECT epoch::int, token::int FROM fence.acquire($1, 'h1', interval '5 minutes')", [job])
      expect(r.rows[0].epoch >= 1 && r.rows[0].token >= 1, `acquire: ${JSON.stringify(r.rows)}`)
      expectEq(await sqlstateOf(c.query("SELECT * FROM fence.acquire($1, 'h2', interval '5 minutes')", [job])), 'FN002', "a second holder's acquire")
    })
  },

  async fence_commit() {
    const [job, , token] = await committedGeneration('commit')
    expectEq(await resultRow(job), { payload: 'p1', token }, 'the committed row')
    expectEq(await receiptKinds(job), PROXY ? 'v1' : 'backstop-v1', 'receipts (digest versions)')
  },

  async fence_replay() {
    if (!PROXY) throw new NotApplicable('receipts are written by the proxy')
    const [job, epoch, token] = await committedGeneration('replay')
    const notices = []
    await commitOnce(job, epoch, token, 'p1', notices)
    expectEq(notices, ['FN00R'], 'notices of the retried commit')
    expectEq(await receipts(job), 1, 'receipts')
    expectEq(await resultRow(job), { payload: 'p1', token }, 'the row')
  },

  async fence_conflict() {
    if (!PROXY) throw new NotApplicable('receipts are written by the proxy')
    const [job, epoch, token] = await committedGeneration('conflict')
    await withClients([fencedConfig(job, epoch, token)], async (c) => {
      await c.query('BEGIN')
      await c.query(UPSERT, [job, 'something else', token])
      expectEq(await sqlstateOf(c.query('COMMIT')), 'FN003', 'a different payload under a committed generation')
      expectEq((await c.query('SELECT 1 AS v')).rows[0].v, 1, 'after the conflict')
    })
    expectEq(await resultRow(job), { payload: 'p1', token }, 'the row')
  },

  async fence_stale() {
    const job = jobKey('stale')
    const [epoch, old] = await acquire(job)
    await withClients([{ port: OBSERVER_PORT }], async (obs) => {
      await obs.query('SELECT fence.release($1, $2)', [job, old])
      await obs.query("SELECT fence.acquire($1, 'h2', interval '5 minutes')", [job])
    })
    await withClients([fencedConfig(job, epoch, old)], async (c) => {
      await c.query('BEGIN')
      let code = await sqlstateOf(c.query(UPSERT, [job, 'zombie', old]))
      if (code === null) code = await sqlstateOf(c.query('COMMIT'))
      expectEq(code, 'FN001', 'a write under the token taken over')
      await c.query('ROLLBACK')
      expectEq((await c.query('SELECT 1 AS v')).rows[0].v, 1, 'after FN001')
    })
    expectEq(await resultRow(job), null, 'the row')
  },

  async fence_autocommit() {
    const job = jobKey('autocommit')
    const [epoch, token] = await acquire(job)
    await withClients([fencedConfig(job, epoch, token)], (c) => c.query(UPSERT, [job, 'auto', token]))
    expectEq(await resultRow(job), { payload: 'auto', token }, 'the row')
    expectEq(await receiptKinds(job), PROXY ? 'v1' : 'backstop-v1', 'receipts (digest versions)')
  },

  async fence_copy() {
    const job = jobKey('copy')
    const [epoch, token] = await acquire(job)
    await withClients([fencedConfig(job, epoch, token)], (c) =>
      streamPipeline(Readable.from([`${job}\tcopied\t${token}\n`]), c.query(copyStreams.from('COPY results (job_key, payload, token) FROM STDIN'))))
    expectEq(await resultRow(job), { payload: 'copied', token }, 'the row')
    expectEq(await receiptKinds(job), PROXY ? 'v1' : 'backstop-v1', 'receipts (digest versions)')
  },

  async fence_no_metadata() {
    await withClients([{}], async (c) => {
      expectEq(await sqlstateOf(c.query(UPSERT, [jobKey('nometa'), 'x', 1])), 'FN008', 'a write without fence metadata')
    })
    expectEq(await resultRow(jobKey('nometa')), null, 'the row')
  },

  async fence_pipeline() {
    const job = jobKey('pipeline')
    const [epoch, token] = await acquire(job)
    await withClients([{ ...fencedConfig(job, epoch, token), pipeline: true }], async (c) => {
      const qs = [c.query('BEGIN'), c.query('SELECT 1'), c.query(UPSERT, [job, 'piped', token]), c.query('COMMIT')]
      await Promise.all(qs)
    })
    expectEq(await resultRow(job), { payload: 'piped', token }, 'the row')
    expectEq(await receiptKinds(job), PROXY ? 'v1' : 'backstop-v1', 'receipts (digest versions)')
    return 'pipeline: true, BEGIN … COMMIT'
  },
}

function jobKey(check) {
  return `node-postgres:${check}`
}

function fencedConfig(job, epoch, token) {
  return { options: `-c fence.job_key=${job} -c fence.epoch=${epoch} -c fence.token=${token}` }
}

async function acquire(job, holder = 'h1') {
  return withClients([{ port: OBSERVER_PORT }], async (obs) => {
    const r = await obs.query("SELECT epoch::int, token::int FROM fence.acquire($1, $2, interval '5 minutes')", [job, holder])
    return [r.rows[0].epoch, r.rows[0].token]
  })
}

// receiptKinds: the digest versions of job's receipts: the proxy's v1, or
// straight to PostgreSQL the backstop's backstop-v1.
async function receiptKinds(job) {
  return withClients([{ port: OBSERVER_PORT }], async (obs) =>
    (await obs.query("SELECT coalesce(string_agg(digest_version, ',' ORDER BY token), '') AS k FROM fence.receipts WHERE job_key = $1", [job])).rows[0].k)
}

async function receipts(job) {
  return withClients([{ port: OBSERVER_PORT }], async (obs) =>
    (await obs.query('SELECT count(*)::int AS n FROM fence.receipts WHERE job_key = $1', [job])).rows[0].n)
}

async function resultRow(job) {
  return withClients([{ port: OBSERVER_PORT }], async (obs) => {
    const r = await obs.query('SELECT payload, token::int FROM results WHERE job_key = $1', [job])
    return r.rows[0] || null
  })
}

async function commitOnce(job, epoch, token, payload, notices) {
  await withClients([fencedConfig(job, epoch, token)], async (c) => {
    if (notices) c.on('notice', (n) => notices.push(n.code))
    await c.query('BEGIN')
    await c.query(UPSERT, [job, payload, token])
    await c.query('COMMIT')
  })
}

async function committedGeneration(check) {
  const job = jobKey(check)
  const [epoch, token] = await acquire(job)
  await commitOnce(job, epoch, token, 'p1')
  return [job, epoch, token]
}

function clean(s) {
  return String(s).split(/\s+/).join(' ').slice(0, 500)
}

async function main() {
  for (const [name, fn] of Object.entries(checks)) {
    let status = 'ok'
    let detail = ''
    try {
      detail = (await fn()) || ''
    } catch (e) {
      if (e instanceof NotApplicable) {
        status = 'n/a'
        detail = e.message
      } else {
        status = 'fail'
        detail = `${e.code ? e.code + ': ' : ''}${e.message}`
        console.error(`${name}: ${e.stack}`)
      }
    }
    console.log(['check', VARIANT, name, status, clean(detail)].join('\t'))
  }
}

main().catch((e) => {
  console.error(e)
  process.exit(1)
})
