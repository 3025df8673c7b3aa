// The bundled workflows in ComfyUI's real frontend, headless: each one is loaded into a running
// ComfyUI (with no model files) the way the frontend loads a workflow, and the missing-models list
// the frontend shows (its error panel) is printed: every loader's file with its Download button.
// The first workflow's view is saved as a PNG.
//
// Needs Node.js, `npm install playwright-core` and a Chromium (Debian: apt-get install chromium).
// Start ComfyUI first with an empty models folder, e.g.
//   python main.py --cpu --listen 127.0.0.1 --port 8199 --base-directory /tmp/empty_comfy_base
// then, from the repository root:
//   node tools/missing_models_check.js http://127.0.0.1:8199 docs/workflows/missing_models.png workflows/*.json
// Exit code 1 when a workflow's panel lacks one of its loaders' files or a Download button.
const { launch, loadWorkflow } = require('./frontend');

const LOADERS = new Set(['UNETLoader', 'CLIPLoader', 'VAELoader']);

async function missingModels(page, url, file) {
  const { workflow } = await loadWorkflow(page, url, file, { dialogs: true, settleMs: 3000 });
  const details = page.getByText('View details');
  if (await details.count()) {
    await details.first().click();
    await page.waitForTimeout(2000);
  }
  const panel = await page.evaluate(() => {
    const found = Array.from(document.querySelectorAll('div'))
      .filter(d => d.innerText && d.innerText.includes('Missing Models') && d.innerText.includes('Download all'))
      .sort((a, b) => a.innerText.length - b.innerText.length);
    return found.length ? found[0].innerText : '';
  });
  const expected = workflow.nodes.filter(n => LOADERS.has(n.type)).map(n => n.widgets_values[0]);
  const lines = panel.split('\n').map(s => s.trim());
  const missing = expected.filter(f => {
    const i = lines.indexOf(f);
    return i < 0 || !lines.slice(i, i + 4).includes('Download');
  });
  return { panel, expected, missing };
}

(async () => {
  const [url, png, ...files] = process.argv.slice(2);
  if (!url || !png || !files.length) {
    console.error('usage: node tools/missing_models_check.js URL OUT.png WORKFLOW.json...');
    process.exit(2);
  }
  const browser = await launch();
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  let failed = false;
  for (const [i, file] of files.entries()) {
    const { panel, expected, missing } = await missingModels(page, url, file);
    console.log(`${file}: ${expected.length - missing.length}/${expected.length} loader files listed with Download`
                + (missing.length ? `; NOT listed: ${missing.join(', ')}` : ''));
    console.log('  ' + panel.split('\n').filter(s => s.trim()).join(' | '));
    failed ||= missing.length > 0;
    if (i === 0) await page.screenshot({ path: png });
  }
  await browser.close();
  process.exit(failed ? 1 : 0);
})().catch(err => { console.error(err); process.exit(1); });
