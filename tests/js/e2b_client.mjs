// E2B's JS SDK (npm `e2b`, pinned), unchanged, against husk's E2B API.
// Run by tests/daemon.rs with E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY.
import { Sandbox, CommandExitError, NotFoundError } from 'e2b'

const template = process.env.HUSK_E2B_TEMPLATE || 'base'
// A guest on an emulating host is slow: generous timeouts, longer on a
// loaded host (the test sets HUSK_PATIENCE_S by the host's load).
const patienceMs = Number(process.env.HUSK_PATIENCE_S ?? 300) * 1000
const slow = { requestTimeoutMs: patienceMs }
const run = { ...slow, timeoutMs: patienceMs }

function check(ok, what) {
  if (!ok) throw new Error(`check failed: ${what}`)
}

const sbx = await Sandbox.create(template, { ...slow, timeoutMs: 600_000, metadata: { suite: 'js' } })
try {
  let streamed = ''
  const r = await sbx.commands.run('echo hi; whoami; pwd', {
    ...run,
    onStdout: (d) => { streamed += d },
  })
  check(r.exitCode === 0 && r.stdout === 'hi\nuser\n/home/user\n', JSON.stringify(r))
  check(streamed === r.stdout, `streamed ${JSON.stringify(streamed)}`)

  let failed = null
  try {
    await sbx.commands.run('echo err >&2; exit 5', run)
  } catch (e) {
    failed = e
  }
  check(failed instanceof CommandExitError && failed.exitCode === 5, String(failed))
  check(failed.stderr === 'err\n', JSON.stringify(failed.stderr))

  const bg = await sbx.commands.run('sleep 600', { ...slow, background: true, timeoutMs: 0 })
  check(bg.pid > 0, `pid ${bg.pid}`)
  check((await bg.kill()) === true, 'kill')

  await sbx.files.write('/home/user/js.txt', 'hello js\n', slow)
  check((await sbx.files.read('/home/user/js.txt', slow)) === 'hello js\n', 'read')
  check(await sbx.files.exists('/home/user/js.txt', slow), 'exists')
  check((await sbx.files.list('/home/user', slow)).some((e) => e.name === 'js.txt'), 'list')
  check((await sbx.files.makeDir('/home/user/jsdir', slow)) === true, 'makeDir')
  await sbx.files.rename('/home/user/js.txt', '/home/user/jsdir/js2.txt', slow)
  check((await sbx.files.read('/home/user/jsdir/js2.txt', slow)) === 'hello js\n', 'renamed')
  await sbx.files.remove('/home/user/jsdir', slow)
  check(!(await sbx.files.exists('/home/user/jsdir', slow)), 'removed')

  // watchDir: the WatchDir stream.
  await sbx.files.makeDir('/home/user/watched', slow)
  const seen = []
  const watch = await sbx.files.watchDir('/home/user/watched', (ev) => seen.push(ev.name), slow)
  await sbx.files.write('/home/user/watched/new.txt', 'x', slow)
  const deadline = Date.now() + patienceMs
  while (!seen.includes('new.txt') && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 200))
  }
  await watch.stop()
  check(seen.includes('new.txt'), `watched ${JSON.stringify(seen)}`)

  const listed = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()
  check(listed.length === 1 && listed[0].sandboxId === sbx.sandboxId, JSON.stringify(listed))
  await sbx.setTimeout(900_000)
} finally {
  await sbx.kill()
}

let missing = null
try {
  await Sandbox.connect('sb-000000000000')
} catch (e) {
  missing = e
}
check(missing instanceof NotFoundError, String(missing))
console.log('e2b js sdk: ok')
