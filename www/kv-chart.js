// The Generate panel's line chart: KV bytes allocated (y) against tokens in the cache (x), one
// line per run, on a 2D canvas in the style of the other charts. The points are also on the
// canvas as `data-series` (JSON { name: [[tokens, bytes], …] }) for tests and curious readers.

export const COLORS = { f16: '#718096', xquant: '#38a169' };
const LABELS = { f16: 'f16 cache', xquant: 'XQuant' };

export class KvChart {
  constructor(canvas) {
    this.canvas = canvas;
    this.series = {};
  }

  clear() {
    this.series = {};
    this.draw();
  }

  add(name, tokens, bytes) {
    (this.series[name] ??= []).push([tokens, bytes]);
    this.draw();
  }

  draw() {
    const c = this.canvas;
    const g = c.getContext('2d');
    c.dataset.series = JSON.stringify(this.series);
    g.clearRect(0, 0, c.width, c.height);
    const points = Object.values(this.series).flat();
    const left = 70;
    const bottom = c.height - 40;
    const top = 18;
    const right = c.width - 10;
    g.strokeStyle = '#999';
    g.beginPath();
    g.moveTo(left, top);
    g.lineTo(left, bottom);
    g.lineTo(right, bottom);
    g.stroke();
    g.fillStyle = '#333';
    g.font = '11px sans-serif';
    g.fillText('tokens in the cache', (left + right) / 2 - 50, bottom + 12);
    if (points.length === 0) {
      g.fillText('KV bytes allocated: run Generate', left + 8, top + 12);
      return;
    }
    const maxX = Math.max(1, ...points.map(([x]) => x));
    const minX = Math.min(maxX - 1, ...points.map(([x]) => x));
    const maxY = Math.max(1, ...points.map(([, y]) => y)) * 1.08;
    const px = (x) => left + ((x - minX) / (maxX - minX)) * (right - left);
    const py = (y) => bottom - (y / maxY) * (bottom - top);
    g.fillText(`${(maxY / 2 ** 20).toFixed(2)} MiB`, 4, top + 4);
    g.fillText('0', left - 12, bottom + 4);
    g.fillText(String(minX), left, bottom + 12);
    g.fillText(String(maxX), right - 24, bottom + 12);
    Object.entries(this.series).forEach(([name, pts], s) => {
      g.strokeStyle = COLORS[name] ?? '#2b6cb0';
      g.lineWidth = 2;
      g.beginPath();
      pts.forEach(([x, y], i) => (i ? g.lineTo(px(x), py(y)) : g.moveTo(px(x), py(y))));
      g.stroke();
      const [lx, ly] = pts[pts.length - 1];
      g.fillStyle = COLORS[name] ?? '#2b6cb0';
      g.fillRect(left + 10 + s * 260, c.height - 14, 10, 8);
      g.fillStyle = '#333';
      g.fillText(`${LABELS[name] ?? name}: ${(ly / 2 ** 20).toFixed(2)} MiB at ${lx}`, left + 24 + s * 260, c.height - 6);
    });
    g.lineWidth = 1;
  }
}
