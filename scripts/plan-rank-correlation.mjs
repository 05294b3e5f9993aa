#!/usr/bin/env node
// Spearman rank correlation between the planner's error of plans (`xquant plan KV --score
// ... --json`) and their measured Δ perplexity (`xquant eval ... --json`, one or more runs).
// Rows are matched by plan name (the `name` in a scored plan file, or a preset's name).
// `--field attention_error` ranks by the attention-output error (`--score` on a capture with
// queries) instead of the planner's error. A plan measured in several runs counts once (the
// last run's row).
//
//   node scripts/plan-rank-correlation.mjs [--field error|attention_error] SCORES.json EVAL.json [EVAL.json ...]
//   node scripts/plan-rank-correlation.mjs data/plan-scores-smollm2-moby-1024.json \
//        data/eval-smollm2-moby-1024.json
import { existsSync, readFileSync } from 'node:fs';

const args = process.argv.slice(2);
let field = 'error';
if (args[0] === '--field') {
  field = args[1];
  args.splice(0, 2);
}
const [scoresPath, ...evalPaths] = args;
if (!scoresPath || evalPaths.length === 0) {
  console.error('usage: plan-rank-correlation.mjs SCORES.json EVAL.json [EVAL.json ...]');
  process.exit(2);
}
const scores = JSON.parse(readFileSync(scoresPath, 'utf8')).scores;
// An eval's JSON has `rows`; data/eval-*.json keep several runs under `runs`.
const rows = evalPaths.flatMap((p) => {
  const d = JSON.parse(readFileSync(p, 'utf8'));
  return d.rows ?? d.runs.flatMap((r) => r.rows);
});
const delta = new Map(rows.map((r) => [r.name, r.delta_perplexity / (r.perplexity - r.delta_perplexity)]));
const pairs = [];
for (const s of scores) {
  const name = existsSync(s.plan) ? JSON.parse(readFileSync(s.plan, 'utf8')).name : s.plan;
  if (!delta.has(name)) {
    console.error(`no eval row for ${s.plan}`);
    continue;
  }
  if (typeof s[field] !== 'number') {
    console.error(`${s.plan} has no ${field}`);
    process.exit(2);
  }
  pairs.push({ name, error: s[field], delta: delta.get(name) });
}
const ranks = (xs) => {
  const order = xs.map((x, i) => [x, i]).sort((a, b) => a[0] - b[0]);
  const r = new Array(xs.length);
  for (let i = 0; i < order.length; ) {
    let j = i;
    while (j + 1 < order.length && order[j + 1][0] === order[i][0]) j++;
    for (let k = i; k <= j; k++) r[order[k][1]] = (i + j) / 2 + 1;
    i = j + 1;
  }
  return r;
};
const [re, rd] = [ranks(pairs.map((p) => p.error)), ranks(pairs.map((p) => p.delta))];
const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
const [me, md] = [mean(re), mean(rd)];
const cov = re.reduce((s, x, i) => s + (x - me) * (rd[i] - md), 0);
const sd = (xs, m) => Math.sqrt(xs.reduce((s, x) => s + (x - m) ** 2, 0));
const rho = cov / (sd(re, me) * sd(rd, md));
console.log(`| plan | ${field} | Δ ppl | error rank | Δ ppl rank |`);
console.log('|---|---:|---:|---:|---:|');
pairs.forEach((p, i) => console.log(`| ${p.name} | ${p.error.toPrecision(4)} | ${(100 * p.delta).toFixed(1)}% | ${re[i]} | ${rd[i]} |`));
console.log(`\nSpearman rank correlation over ${pairs.length} plans: ${rho.toFixed(3)}`);
