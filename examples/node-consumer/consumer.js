// A cdc consumer in Node.js: keeps the total distance of all rides, exactly.
//
// It reads the cdc:ride stream with a consumer group (its own pending entries
// first after a restart, then new ones), skips entries at or below its
// checkpoint (lsn, seq), and writes total + checkpoint + XACK in one MULTI/EXEC,
// so state and acknowledgement never disagree.
//
//   node consumer.js --redis redis://127.0.0.1:6379/0 [--stream cdc:ride] [--group node-total] [--name NAME]
'use strict';
const os = require('os');
const { createClient } = require('redis');

function option(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
}
const url = option('redis', 'redis://127.0.0.1:6379/0');
const stream = option('stream', 'cdc:ride');
const group = option('group', 'node-total');
const name = option('name', `${os.hostname()}-${process.pid}`);
const totalKey = `cdc:example:${group}:total`;        // thousandths of a metre, as a decimal string
const checkpointKey = `cdc:example:${group}:checkpoint`; // "lsn:seq" of the last applied entry

// numeric(12,3) arrives as an exact string: keep it exact as an integer of thousandths.
function thousandths(text) {
  const negative = text.startsWith('-');
  const [whole, fraction = ''] = (negative ? text.slice(1) : text).split('.');
  const value = BigInt(whole) * 1000n + BigInt((fraction + '000').slice(0, 3));
  return negative ? -value : value;
}

function fields(flat) {
  const out = {};
  for (let i = 0; i < flat.length; i += 2) out[flat[i]] = flat[i + 1];
  return out;
}

function after(a, b) { // positions are [BigInt lsn, BigInt seq]
  return a[0] > b[0] || (a[0] === b[0] && a[1] > b[1]);
}

async function main() {
  const client = createClient({ url });
  await client.connect();
  try {
    await client.sendCommand(['XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM']);
  } catch (err) {
    if (!String(err.message).includes('BUSYGROUP')) throw err;
  }
  let stopping = false;
  process.on('SIGTERM', () => { stopping = true; });
  process.on('SIGINT', () => { stopping = true; });
  let readPending = true; // after a restart, our own unacknowledged entries come first
  while (!stopping) {
    const id = readPending ? '0' : '>';
    const args = ['XREADGROUP', 'GROUP', group, name, 'COUNT', '100'];
    if (!readPending) args.push('BLOCK', '1000');
    args.push('STREAMS', stream, id);
    const reply = await client.sendCommand(args);
    const entries = reply ? reply[0][1].filter((e) => e[1] !== null) : [];
    if (entries.length === 0) {
      readPending = false;
      continue;
    }
    await client.watch([totalKey, checkpointKey]);
    let total = BigInt((await client.get(totalKey)) || '0');
    const saved = await client.get(checkpointKey);
    let mark = saved ? saved.split(':').map(BigInt) : [-1n, -1n];
    for (const [, flat] of entries) {
      const entry = fields(flat);
      const position = [BigInt(entry.lsn), BigInt(entry.seq)];
      if (!after(position, mark)) continue; // a redelivery or a duplicate send
      mark = position;
      const data = entry.data ? JSON.parse(entry.data) : null;
      const before = entry.before ? JSON.parse(entry.before) : null;
      if (entry.op === 'c' || entry.op === 'r') total += thousandths(data.distance);
      else if (entry.op === 'u') total += thousandths(data.distance) - thousandths(before.distance);
      else if (entry.op === 'd') total -= thousandths(before.distance);
      else if (entry.op === 't' || entry.op === 'x') total = 0n; // x: the stream was rebuilt (cdc recover)
    }
    const ids = entries.map((e) => e[0]);
    try {
      await client.multi()
        .set(totalKey, total.toString())
        .set(checkpointKey, `${mark[0]}:${mark[1]}`)
        .xAck(stream, group, ids)
        .exec();
    } catch (err) {
      if (err.name !== 'WatchError') throw err;
      readPending = true; // the state changed under us: nothing was written, read again
    }
  }
  await client.quit();
}

main().catch((err) => {
  console.error(`node consumer: error: ${err.message}`);
  process.exit(1);
});
