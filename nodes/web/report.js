// Gives the "Sparse Attention Report" node room for its report, which ComfyUI draws as the
// node's progress text inside the node's body (a new node is otherwise too small to show it).
import { app } from "../../scripts/app.js";

const REPORT_NODE = "SparseAttentionReportH3";
const MIN_SIZE = [560, 210];

app.registerExtension({
  name: "adaptive_sparse_attention.report",
  nodeCreated(node) {
    if (node.comfyClass !== REPORT_NODE) return;
    node.setSize([Math.max(node.size[0], MIN_SIZE[0]), Math.max(node.size[1], MIN_SIZE[1])]);
  },
});
