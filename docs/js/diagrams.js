// The diagram renderer (3.5 MB) is loaded only by pages that have a diagram, before the theme
// draws them; the theme uses it instead of fetching one from a CDN. Written in while the page
// is parsed, so it runs before the page is ready; arrowheads.js after it, for the same reason.
if (document.querySelector("pre.mermaid")) {
  const here = document.currentScript.src;
  for (const name of ["mermaid/mermaid-11.17.2.min.js", "arrowheads.js"]) {
    document.write(`<script src="${new URL(name, here).pathname}"></` + "script>");
  }
}
