// The README's pictures, from the current nodes: each bundled workflow opened in ComfyUI's real
// frontend, headless, fitted to the window and saved as docs/workflows/<workflow>.png.
//
// Needs Node.js, `npm install playwright-core` and a Chromium (Debian: apt-get install chromium).
// Start ComfyUI first with this pack (and ComfyUI-KJNodes, for the low-VRAM workflow) in its
// custom_nodes, e.g.
//   python main.py --cpu --listen 127.0.0.1 --port 8199 --disable-auto-launch --disable-api-nodes \
//       --base-directory /tmp/comfy_base        # /tmp/comfy_base/custom_nodes/<this pack>
// with a file of each name the workflows load under models/ and input/ (empty ones will do: the
// frontend only lists them), so that no loader is drawn as a missing file. It sets three frontend
// settings on that ComfyUI (template browser seen, no minimap, node text at every zoom): use a
// scratch base directory. Then, from the repository root:
//   node tools/workflow_screenshots.js http://127.0.0.1:8199 docs/workflows workflows/*.json
// Exit code 1 when a workflow shows a node type the server does not know (a red, missing node).
const path = require('path');
const { launch, loadWorkflow } = require('./frontend');

async function open(page, url, file) {
  const { name } = await loadWorkflow(page, url, file, { dialogs: false, settleMs: 4000 });
  // close what the frontend opens over the graph (the template browser of a new user, toasts)
  await page.evaluate(() => document.querySelectorAll(
    '[role="dialog"] button[aria-label="Close"], .p-dialog-close-button, .p-toast-close-button')
    .forEach(b => b.click()));
  for (let i = 0; i < 3; i++) await page.keyboard.press('Escape');
  await page.waitForTimeout(1000);
  // frontend-only types (notes) are registered in the page, every other type must come from the server
  const unknown = await page.evaluate(() => window.app.graph.nodes
    .filter(n => !window.LiteGraph.registered_node_types[n.type]).map(n => n.type));
  await page.evaluate(async () => {  // the whole graph in the window
    await window.app.extensionManager.command.execute('Comfy.Canvas.FitView');
  });
  await page.waitForTimeout(1500);
  return { name, unknown };
}

(async () => {
  const [url, outDir, ...files] = process.argv.slice(2);
  if (!url || !outDir || !files.length) {
    console.error('usage: node tools/workflow_screenshots.js URL OUT_DIR WORKFLOW.json...');
    process.exit(2);
  }
  // no first-run template browser, no minimap, node text at every zoom
  for (const [id, value] of [['Comfy.TutorialCompleted', true], ['Comfy.Minimap.Visible', false],
                             ['LiteGraph.Canvas.MinFontSizeForLOD', 0]]) {
    await fetch(`${url}/settings/${id}`, { method: 'POST', body: JSON.stringify(value) });
  }
  const browser = await launch();
  let failed = false;
  for (const file of files) {  // a fresh context each: no tabs of the workflows before
    const page = await browser.newPage({ viewport: { width: 2400, height: 1350 } });
    const { name, unknown } = await open(page, url, file);
    const png = path.join(outDir, `${name}.png`);
    await page.screenshot({ path: png });
    console.log(`${file}: ${png}` + (unknown.length ? `; unknown node types: ${unknown.join(', ')}` : ''));
    failed = failed || unknown.length > 0;
    await page.close();
  }
  await browser.close();
  process.exit(failed ? 1 : 0);
})();
