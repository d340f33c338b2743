-- Copyright (c) zeromib.gpu contributors
-- GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
-- SPDX-License-Identifier: GPL-3.0-or-later
--
-- The pandoc filter of tests/tools/md_to_guide.sh: a Markdown guide of docs/ becomes a docsite
-- guide of docs/docsite/rst/ as antsibull-docs wants it. Every tidy step is here, so that running
-- the script again on an edited Markdown page gives the same guide:
--   * one label for the page and one for each section, all under the collection's prefix
--     (antsibull-docs lint refuses any other label);
--   * links to another guide or a section of one become :ref:, links to a module or role page
--     become :ref: to the reference antsibull-docs builds from DOCUMENTATION and argument_specs,
--     links to any other file of the repository become links to it on GitHub;
--   * code blocks become `.. code-block::`, tables `.. list-table::`, a lone image `.. image::`;
--   * a table of variables that a role's meta/argument_specs.yml (or a module's DOCUMENTATION)
--     already documents is replaced by a reference to that page: the reference is the one place.
-- Metadata from the script: guide (the page's name, e.g. guide_health), source (the Markdown
-- file, relative to the repository root), repo (the repository root).

local PREFIX = "ansible_collections.zeromib.gpu.docsite."
local GITHUB = "https://github.com/zeromib/gpu/blob/main/"
local RST_DIR = "docs/docsite/rst"

-- Markdown page (relative to docs/) -> docsite guide.
local GUIDES = {
  ["attribution.md"] = "guide_attribution",
  ["audit.md"] = "guide_audit",
  ["containers.md"] = "guide_containers",
  ["design.md"] = "guide_design",
  ["free.md"] = "guide_free",
  ["health.md"] = "guide_health",
  ["restarters.md"] = "guide_restarters",
  ["restore_gpus.md"] = "guide_restore",
  ["security.md"] = "guide_security",
  ["slurm.md"] = "guide_slurm",
  ["smoke_test.md"] = "guide_smoke_test",
  ["troubleshooting.md"] = "guide_troubleshooting",
}
-- Generated reference pages (tests/tools/gen_docs.py) -> the page antsibull-docs builds.
local REFERENCE = {
  ["gpu_facts.md"] = {"ansible_collections.zeromib.gpu.gpu_facts_module", "zeromib.gpu.gpu_facts module"},
  ["gpu_release.md"] = {"ansible_collections.zeromib.gpu.gpu_release_module", "zeromib.gpu.gpu_release module"},
  ["gpu_restore.md"] = {"ansible_collections.zeromib.gpu.gpu_restore_module", "zeromib.gpu.gpu_restore module"},
  ["slurm_node.md"] = {"ansible_collections.zeromib.gpu.slurm_node_module", "zeromib.gpu.slurm_node module"},
  ["free_gpus.md"] = {"ansible_collections.zeromib.gpu.free_gpus_role", "zeromib.gpu.free_gpus role"},
}
-- Where a table's names may already be documented, and the reference page of each.
local SPEC_FILES = {
  {"roles/free_gpus/meta/argument_specs.yml", "ansible_collections.zeromib.gpu.free_gpus_role", "zeromib.gpu.free_gpus role"},
  {"roles/restore_gpus/meta/argument_specs.yml", "ansible_collections.zeromib.gpu.restore_gpus_role", "zeromib.gpu.restore_gpus role"},
  {"roles/slurm_gpu_checks/meta/argument_specs.yml", "ansible_collections.zeromib.gpu.slurm_gpu_checks_role", "zeromib.gpu.slurm_gpu_checks role"},
  {"plugins/modules/gpu_facts.py", "ansible_collections.zeromib.gpu.gpu_facts_module", "zeromib.gpu.gpu_facts module"},
  {"plugins/modules/gpu_release.py", "ansible_collections.zeromib.gpu.gpu_release_module", "zeromib.gpu.gpu_release module"},
  {"plugins/modules/gpu_restore.py", "ansible_collections.zeromib.gpu.gpu_restore_module", "zeromib.gpu.gpu_restore module"},
}
-- pandoc 2.17's RST writer puts no blank line after a raw block; md_to_guide.sh turns this line
-- into one (and drops it where a blank line follows anyway).
local RAW_END = "\n@@md_to_guide:raw-end@@"

local function raw(text)
  return pandoc.RawBlock("rst", text .. RAW_END)
end

local LANGUAGES = {yaml = "yaml", sh = "shell", bash = "shell", console = "console", ini = "ini",
                   json = "json", text = "text", python = "python"}

local guide, source, repo, source_dir = "guide", "docs/guide.md", ".", "docs"

local function split_path(path)
  local parts = {}
  for part in path:gmatch("[^/]+") do
    if part == ".." then
      table.remove(parts)
    elseif part ~= "." then
      table.insert(parts, part)
    end
  end
  return parts
end

-- A link target relative to the Markdown page -> a path relative to the repository root.
local function repo_path(target)
  local trailing = target:sub(-1) == "/"
  local path = table.concat(split_path(source_dir .. "/" .. target), "/")
  return trailing and path .. "/" or path
end

-- A repository path -> the same path relative to docs/docsite/rst (for images).
local function from_rst_dir(path)
  local up = split_path(RST_DIR)
  return string.rep("../", #up) .. path
end

local function anchor_label(page_guide, anchor)
  if anchor == nil or anchor == "" then
    return PREFIX .. page_guide
  end
  return PREFIX .. page_guide .. "." .. anchor
end

local function escape_rst_text(text)
  return (text:gsub("([`<>\\])", "\\%1"))
end

local function ref(text, label)
  if text == nil or text == "" or text:match("%.md$") or text:match("%.md#") then
    -- "security.md": the guide's own title says it better.
    return pandoc.RawInline("rst", ":ref:`" .. label .. "`")
  end
  return pandoc.RawInline("rst", ":ref:`" .. escape_rst_text(text) .. " <" .. label .. ">`")
end

function Link(el)
  local target = el.target
  local text = pandoc.utils.stringify(el.content)
  if target:match("^%a[%w+.-]*:") then
    if text == target then
      return nil
    end
    return pandoc.RawInline("rst", "`" .. escape_rst_text(text) .. " <" .. target .. ">`__")
  end
  local file, anchor = target:match("^([^#]*)#?(.*)$")
  if file == "" then
    return ref(text, anchor_label(guide, anchor))
  end
  local name = file:match("([^/]+)$")
  local in_docs = repo_path(file):match("^docs/[^/]+$") ~= nil
  if in_docs and GUIDES[name] then
    return ref(text, anchor_label(GUIDES[name], anchor))
  end
  if in_docs and REFERENCE[name] then
    local label, title = table.unpack(REFERENCE[name])
    return ref(text:match("%.md$") and title or text, label)
  end
  local url = GITHUB .. repo_path(file)
  if file:sub(-1) == "/" then
    url = url:gsub("/blob/main/", "/tree/main/")
  end
  if anchor ~= "" then
    url = url .. "#" .. anchor
  end
  return pandoc.RawInline("rst", "`" .. escape_rst_text(text) .. " <" .. url .. ">`__")
end

local function indent(text, prefix)
  local lines = {}
  for line in (text .. "\n"):gmatch("(.-)\n") do
    table.insert(lines, line == "" and "" or prefix .. line)
  end
  return table.concat(lines, "\n")
end

function CodeBlock(el)
  local language = LANGUAGES[el.classes[1] or "text"] or el.classes[1] or "text"
  return raw(".. code-block:: " .. language .. "\n\n" .. indent(el.text, "    "))
end

function Para(el)
  if #el.content == 1 and el.content[1].t == "Image" then
    local image = el.content[1]
    local path = image.src:match("^%a[%w+.-]*:") and image.src or from_rst_dir(repo_path(image.src))
    local alt = pandoc.utils.stringify(image.caption)
    return raw(".. image:: " .. path .. "\n   :alt: " .. alt)
  end
end

local function read_file(path)
  local handle = io.open(repo .. "/" .. path, "r")
  if not handle then
    return nil
  end
  local content = handle:read("a")
  handle:close()
  return content
end

-- The names of a table whose first column holds only code names (`free_gpus_x`), or nil.
local function table_names(tbl)
  local head = tbl.head.rows[1]
  if not head then
    return nil
  end
  local first = pandoc.utils.stringify(head.cells[1].contents):lower()
  if first ~= "variable" and first ~= "option" then
    return nil
  end
  local names = {}
  for _, body in ipairs(tbl.bodies) do
    for _, row in ipairs(body.body) do
      local blocks = row.cells[1].contents
      local inlines = blocks[1] and blocks[1].content or {}
      if #inlines ~= 1 or inlines[1].t ~= "Code" then
        return nil
      end
      table.insert(names, inlines[1].text)
    end
  end
  return #names > 0 and names or nil
end

local function documented_in(names)
  for _, spec in ipairs(SPEC_FILES) do
    local content = read_file(spec[1])
    if content then
      local all = true
      for _, name in ipairs(names) do
        if not content:find("\n%s*" .. name:gsub("%p", "%%%0") .. ":") then
          all = false
          break
        end
      end
      if all then
        return spec
      end
    end
  end
  return nil
end

local function cell_rst(cell)
  local text = pandoc.write(pandoc.Pandoc(cell.contents), "rst", {wrap_text = "wrap-none"})
  return text:gsub("%s+$", "")
end

function Table(tbl)
  local names = table_names(tbl)
  local spec = names and documented_in(names)
  if spec then
    return pandoc.Para({pandoc.Str("Each"), pandoc.Space(), pandoc.Str("of"), pandoc.Space(),
                        pandoc.Str("these"), pandoc.Space(), pandoc.Str("is"), pandoc.Space(),
                        pandoc.Str("documented"), pandoc.Space(), pandoc.Str("in"), pandoc.Space(),
                        pandoc.Str("the"), pandoc.Space(), pandoc.Str("reference:"), pandoc.Space(),
                        ref(spec[3], spec[2]), pandoc.Str(".")})
  end
  local rows = {}
  for _, row in ipairs(tbl.head.rows) do
    table.insert(rows, row)
  end
  for _, body in ipairs(tbl.bodies) do
    for _, row in ipairs(body.body) do
      table.insert(rows, row)
    end
  end
  local out = {".. list-table::", "   :header-rows: " .. #tbl.head.rows, ""}
  for _, row in ipairs(rows) do
    for index, cell in ipairs(row.cells) do
      local marker = index == 1 and "   * - " or "     - "
      local text = cell_rst(cell)
      if text == "" then
        table.insert(out, (marker:gsub("%s+$", "")))
      else
        local first, rest = text:match("^([^\n]*)\n?(.*)$")
        table.insert(out, marker .. first)
        if rest ~= "" then
          table.insert(out, indent(rest, "       "))
        end
      end
    end
  end
  return raw(table.concat(out, "\n"))
end

local function label_block(label)
  return raw(".. _" .. label .. ":")
end

function Header(el)
  local id = el.identifier
  el.identifier = ""
  if el.level == 1 then
    return el
  end
  return {label_block(anchor_label(guide, id)), el}
end

local COPYRIGHT = [[
..
  Copyright (c) zeromib.gpu contributors
  GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
  SPDX-License-Identifier: GPL-3.0-or-later]]

function Pandoc(doc)
  table.insert(doc.blocks, 1, raw(COPYRIGHT))
  table.insert(doc.blocks, 2, label_block(PREFIX .. guide))
  return doc
end

function Meta(meta)
  guide = pandoc.utils.stringify(meta.guide or guide)
  source = pandoc.utils.stringify(meta.source or source)
  repo = pandoc.utils.stringify(meta.repo or repo)
  source_dir = source:match("^(.*)/[^/]*$") or "."
end

-- Meta first: every other function needs the page's name and place.
return {{Meta = Meta}, {Link = Link, Image = nil}, {CodeBlock = CodeBlock, Para = Para, Table = Table, Header = Header},
        {Pandoc = Pandoc}}
