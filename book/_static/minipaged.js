// minipaged: the "#| export" and "#| default_exp" lines stay in the chapters' source (tangle
// needs them) but are noise on the page; each exported cell shows a small badge instead.
document.addEventListener("DOMContentLoaded", () => {
  let defaultModule = null; // set by the chapter's "#| default_exp NAME" line
  document.querySelectorAll("div.cell_input pre").forEach((pre) => {
    const directives = [];
    // Pygments renders each directive as one comment span followed by a newline (after an
    // empty span that Sphinx puts first).
    let node = pre.firstChild;
    while (node) {
      const next = node.nextSibling;
      const text = node.textContent;
      if (text === "") {
        node = next;
      } else if (node.nodeType === Node.ELEMENT_NODE && /^#\|/.test(text)) {
        directives.push(text.slice(2).trim());
        pre.removeChild(node);
        node = next;
        if (node && node.nodeType === Node.TEXT_NODE && node.textContent.startsWith("\n")) {
          node.textContent = node.textContent.slice(1);
          const after = node.nextSibling;
          if (!node.textContent) pre.removeChild(node);
          node = after;
        }
      } else {
        break;
      }
    }
    directives.filter((d) => d.startsWith("default_exp"))
      .forEach((d) => { defaultModule = d.split(/\s+/)[1] || defaultModule; });
    const exported = directives.filter((d) => d.startsWith("export"));
    if (!exported.length) return;
    const module = exported[0].split(/\s+/)[1] || defaultModule;
    const badge = document.createElement("div");
    badge.className = "minipaged-export";
    badge.textContent = module ? `exported to minipaged.${module}` : "exported to the package";
    badge.title = "This cell starts with #| export: make tangle writes it into the package.";
    pre.closest("div.cell_input").before(badge);
  });
});

// The download menu's .ipynb is the chapter as executed by the build, outputs included (the
// build copies it to _executed/; see book/_ext/minipaged_book.py). The repository's twin, the
// one Colab opens, carries no outputs on purpose: the build regenerates them.
document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("a.btn-download-notebook-button").forEach((link) => {
    const href = link.getAttribute("href") || "";
    if (!href.includes("_sources/chapters/")) return;
    link.setAttribute("href", href.replace("_sources/chapters/", "_executed/chapters/"));
    link.setAttribute("title", "Download the notebook as executed for this page, with its outputs");
    const text = link.querySelector(".btn__text-container");
    if (text) text.textContent = ".ipynb (executed)";
  });
});
