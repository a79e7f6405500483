// BullMQ's add, with and without a deduplication id, against one Redis: the anchor of the
// dramatiq-guard bench's send rates (python -m bench --only bullmq runs it).
//   node add.mjs <redis port> <N> <rounds>
// Prints one JSON line: the median rates (jobs/s) of a plain add, an add with a new deduplication
// id each time, and an add whose deduplication id is taken (a duplicate), taking turns per round.
import { Queue } from "bullmq";
import IORedis from "ioredis";

const [port, n, rounds] = process.argv.slice(2).map(Number);
const connection = new IORedis({ host: "127.0.0.1", port, maxRetriesPerRequest: null });
const queue = new Queue(`bench-${process.pid}`, { connection });
await queue.waitUntilReady();

const kinds = {
  plain: (i) => queue.add("job", { i }),
  accepted: (i) => queue.add("job", { i }, { deduplication: { id: `new-${i}-${Math.random()}` } }),
  duplicate: (i) => queue.add("job", { i }, { deduplication: { id: "taken" } }),
};
const runs = { plain: [], accepted: [], duplicate: [] };
for (let round = 0; round < rounds; round++) {
  for (const [name, add] of Object.entries(kinds)) {
    const start = process.hrtime.bigint();
    for (let i = 0; i < n; i++) await add(i);
    const seconds = Number(process.hrtime.bigint() - start) / 1e9;
    runs[name].push(n / seconds);
  }
}
const median = (xs) => xs.sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const rates = Object.fromEntries(Object.entries(runs).map(([name, xs]) => [name, median(xs)]));
console.log(JSON.stringify(rates));
await queue.obliterate({ force: true });
await queue.close();
await connection.quit();
