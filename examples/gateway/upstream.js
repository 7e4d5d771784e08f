// A small orders service for the gateway example, tests and benchmark. Node.js only, no npm.
//
// It is NOT idempotent on its own: every POST /orders creates a new order, so a retried
// request is a duplicate order unless something in front (the gateway) prevents it. It counts
// what it did, per forwarded Idempotency-Key, so that tests audit the service itself:
//
//   POST /orders                 create an order from a JSON body; 201 with the order
//        ?delay_ms=N             answer N ms after creating it (a slow upstream)
//        ?status=S               create it, then answer with status S (a failing upstream)
//        ?dedupe=1               dedupe on the forwarded Idempotency-Key: a key seen before
//                                gets the first answer again, without a new order
//        (or the headers X-Delay-Ms, X-Status, X-Dedupe: a retry without them is still
//        "the same request" to the gateway, which fingerprints the query but not headers)
//   GET  /orders/count?key=K     {"created": orders made with key K, "deliveries": requests
//                                 with key K that reached this service}; no key: all orders
//   GET  /items                  a small JSON document (the benchmark's pass-through GET)
//   GET  /download?bytes=N       N bytes, streamed in 64 KiB chunks, with Content-Length
//   GET  /download/stats         {"completed": downloads sent whole, "aborted": cut short}
//   POST /upload                 reads the body as it streams; {"bytes": its length}
//   ANY  /echo[/...]             the request as received: method, target, raw headers, and
//                                the port of the connection it came on
//   GET  /gzip                   a gzip-encoded body (Content-Encoding: gzip)
//   GET  /hop                    a response carrying hop-by-hop headers
//   GET  /health                 200
//
// PORT (0: any free port) and HOST from the environment; it prints "listening on URL".
// UPSTREAM_DELAY_MS=N makes GET /items and POST /orders wait N ms first, as a service that
// calls a database or a provider would (the benchmark's second scenario).
'use strict';

const http = require('node:http');
const zlib = require('node:zlib');

const orders = [];
const createdByKey = new Map();
const deliveriesByKey = new Map();
const answers = new Map(); // key -> the first answer, for ?dedupe=1
const downloads = { completed: 0, aborted: 0 };

const CHUNK = Buffer.alloc(64 * 1024, 'x');
const ITEMS = JSON.stringify({ items: [{ sku: 'A-1', name: 'Widget', price: 1250 }] });
const GZIPPED = zlib.gzipSync(Buffer.from('hello from upstream, compressed\n'.repeat(64)));

function json(res, status, value, headers = {}) {
  const body = Buffer.from(typeof value === 'string' ? value : JSON.stringify(value));
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': body.length, ...headers });
  res.end(body);
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    req.on('data', (chunk) => chunks.push(chunk));
    req.on('end', () => resolve(Buffer.concat(chunks)));
    req.on('error', reject);
  });
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const BASE_DELAY_MS = Number(process.env.UPSTREAM_DELAY_MS || 0);

function option(req, url, name, header) {
  return url.searchParams.get(name) ?? req.headers[header] ?? null;
}

async function createOrder(req, res, url) {
  const key = req.headers['idempotency-key'];
  const body = await readBody(req);
  if (key !== undefined) deliveriesByKey.set(key, (deliveriesByKey.get(key) || 0) + 1);
  if (option(req, url, 'dedupe', 'x-dedupe') === '1' && key !== undefined && answers.has(key)) {
    const first = answers.get(key);
    return json(res, first.status, first.body, first.headers);
  }
  let input;
  try {
    input = JSON.parse(body.toString('utf8') || '{}');
  } catch {
    return json(res, 400, { error: 'the body is not JSON' });
  }
  const order = {
    id: orders.length + 1,
    item: input.sku ?? input.item ?? null,
    quantity: input.quantity ?? 1,
    key: key ?? null,
    created_at: new Date().toISOString(),
  };
  orders.push(order);
  if (key !== undefined) createdByKey.set(key, (createdByKey.get(key) || 0) + 1);
  const status = Number(option(req, url, 'status', 'x-status') || 201);
  const headers = {
    Location: `/orders/${order.id}`,
    'X-Order-Id': String(order.id),
    'Set-Cookie': [`last_order=${order.id}; Path=/`, 'seen=1; Path=/; HttpOnly'],
  };
  if (key !== undefined) answers.set(key, { status, body: JSON.stringify(order), headers });
  const delay = Number(option(req, url, 'delay_ms', 'x-delay-ms') || 0);
  if (delay > 0) await sleep(delay);
  json(res, status, order, headers);
}

function download(res, total) {
  res.writeHead(200, { 'Content-Type': 'application/octet-stream', 'Content-Length': total });
  let left = total;
  const pump = () => {
    while (left > 0) {
      const size = Math.min(left, CHUNK.length);
      left -= size;
      if (!res.write(size === CHUNK.length ? CHUNK : CHUNK.subarray(0, size))) {
        res.once('drain', pump);
        return;
      }
    }
    res.end();
  };
  res.on('close', () => {
    if (res.writableFinished) downloads.completed += 1;
    else downloads.aborted += 1;
    left = 0;
  });
  pump();
}

async function handle(req, res) {
  const url = new URL(req.url, 'http://upstream');
  const route = `${req.method} ${url.pathname}`;
  if (BASE_DELAY_MS > 0 && (route === 'GET /items' || route === 'POST /orders')) await sleep(BASE_DELAY_MS);
  if (route === 'POST /orders') return createOrder(req, res, url);
  if (route === 'GET /orders/count') {
    const key = url.searchParams.get('key');
    if (key === null) return json(res, 200, { created: orders.length });
    return json(res, 200, { created: createdByKey.get(key) || 0, deliveries: deliveriesByKey.get(key) || 0 });
  }
  if (route === 'GET /items') return json(res, 200, ITEMS);
  if (route === 'GET /download/stats') return json(res, 200, downloads);
  if (route === 'GET /download') return download(res, Number(url.searchParams.get('bytes') || 0));
  if (route === 'POST /upload') {
    let bytes = 0;
    req.on('data', (chunk) => { bytes += chunk.length; });
    await new Promise((resolve) => req.on('end', resolve));
    return json(res, 200, { bytes });
  }
  if (url.pathname === '/echo' || url.pathname.startsWith('/echo/')) {
    const body = await readBody(req);
    const headers = [];
    for (let i = 0; i < req.rawHeaders.length; i += 2) headers.push([req.rawHeaders[i], req.rawHeaders[i + 1]]);
    const peer_port = req.socket.remotePort; // which of the gateway's connections carried it
    return json(res, 200, { method: req.method, target: req.url, headers, body_bytes: body.length, peer_port });
  }
  if (route === 'GET /gzip') {
    res.writeHead(200, { 'Content-Type': 'text/plain', 'Content-Encoding': 'gzip', 'Content-Length': GZIPPED.length });
    return res.end(GZIPPED);
  }
  if (route === 'GET /hop') {
    res.writeHead(200, {
      'Content-Type': 'text/plain',
      Connection: 'keep-alive, X-Hop-Secret',
      'X-Hop-Secret': 'for the next hop only',
      'Keep-Alive': 'timeout=5',
      'Proxy-Authenticate': 'Basic realm="upstream"',
      'Proxy-Authentication-Info': 'nextnonce="n1"',
      Upgrade: 'h2c',
      'X-End-To-End': 'kept',
    });
    return res.end('hop\n');
  }
  if (route === 'GET /health') return json(res, 200, { status: 'ok' });
  return json(res, 404, { error: 'no such route' });
}

const server = http.createServer((req, res) => {
  handle(req, res).catch((error) => {
    if (!res.headersSent) json(res, 500, { error: String(error) });
    else res.destroy();
  });
});

function stop() {
  server.close(() => process.exit(0));
  server.closeAllConnections();
}
process.on('SIGTERM', stop);
process.on('SIGINT', stop);

server.listen(Number(process.env.PORT || 9000), process.env.HOST || '127.0.0.1', () => {
  const { address, port } = server.address();
  console.log(`listening on http://${address}:${port}`);
});
