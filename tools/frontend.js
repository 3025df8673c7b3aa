// What the two frontend tools share: a headless Chromium, and a bundled workflow loaded into a running
// ComfyUI's real frontend the way the frontend loads one (workflow_screenshots.js, missing_models_check.js).
const { chromium } = require('playwright-core');
const fs = require('fs');
const path = require('path');

// The Chromium of $CHROMIUM (default /usr/bin/chromium), headless.
function launch() {
  return chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', args: ['--no-sandbox'] });
}

// Open ComfyUI at `url` in `page` and load the workflow in `file` under its file name, with the frontend's
// missing-models and missing-nodes dialogs shown or not (`dialogs`); waits `settleMs` for the graph to draw.
// Returns { workflow, name }.
async function loadWorkflow(page, url, file, { dialogs, settleMs }) {
  const workflow = JSON.parse(fs.readFileSync(file, 'utf8'));
  await page.goto(url, { waitUntil: 'domcontentloaded' });
  await page.waitForFunction(() => window.app && window.app.graph, null, { timeout: 120000 });
  await page.waitForTimeout(2000);
  await page.keyboard.press('Escape');
  const name = path.basename(file, '.json');
  await page.evaluate(([wf, name, dialogs]) => window.app.loadGraphData(wf, true, true, name,
    { showMissingModelsDialog: dialogs, showMissingNodesDialog: dialogs }), [workflow, name, dialogs]);
  await page.waitForTimeout(settleMs);
  return { workflow, name };
}

module.exports = { launch, loadWorkflow };
